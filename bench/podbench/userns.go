package podbench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/kvfs/kvfs/bench/report"
)

// UsernsSectionHeading starts the user-namespace section of docs/measurements/benchmarks.md.
const UsernsSectionHeading = "## Pod level through the CRI: a user-namespaced pod's metadata cost"

// usernsHostID is where the user-namespaced pod maps its container ids 0-65535.
const usernsHostID = 200000

// usernsFiles is how many files the metadata workload makes, stats, chmods and removes.
const usernsFiles = 1000

// usernsWorkload is the metadata workload, run as container root with crictl exec: in the
// container's root file system (the overlay the shim mounts, on idmapped image layers in a
// user-namespaced pod), usernsFiles files made, listed with their owners, chmodded and
// removed; every file of the image listed with its owner (lookups and getattrs through the
// layers) and /etc's files chmodded (copied up from the layers, the first time). It prints
// the guest's /proc/uptime before and after.
var usernsWorkload = fmt.Sprintf(`set -e
t0=$(cut -d' ' -f1 /proc/uptime)
rm -rf /w; mkdir /w; cd /w
i=0; while [ $i -lt %d ]; do echo x > f$i; i=$((i+1)); done
ls -ln /w > /dev/null
chmod 600 /w/*
ls -lnR / 2>/dev/null | wc -l > /dev/null
chmod 644 /etc/* 2>/dev/null || true
cd /; rm -rf /w
t1=$(cut -d' ' -f1 /proc/uptime)
echo "uptimes $t0 $t1"`, usernsFiles)

// UsernsRound is one run of the workload in each pod: its time measured in the guest (from
// /proc/uptime, 10 ms steps) and from the host (crictl exec's wall time, which adds the
// exec's own cost, the same for both pods).
type UsernsRound struct {
	Userns, Plain         time.Duration // in the guest
	UsernsExec, PlainExec time.Duration // crictl exec --sync, wall time
}

// UsernsReport is a user-namespace run's results.
type UsernsReport struct {
	Config            Config
	Machine           Machine
	Accel, AccelWhy   string
	Started, Finished time.Time
	Rounds            []UsernsRound
}

// RunUserns runs the user-namespace benchmark: a kvfs pod with a user namespace (container ids
// 0-65535 to host ids from usernsHostID) and one without, side by side through the same
// handler, each with a container that sleeps; then cfg.Runs rounds, each running the
// metadata workload in one pod then the other, after one uncounted round (the copy-ups, the
// caches).
func RunUserns(ctx context.Context, cfg Config) (_ *UsernsReport, retErr error) {
	p, err := prepare(ctx, &cfg)
	if err != nil {
		return nil, err
	}
	rep := &UsernsReport{Config: cfg, Started: time.Now(), Accel: p.accel, AccelWhy: p.accelWhy}
	rep.Machine = describeMachine(cfg, p.kernel)
	c, err := startCRIRun(cfg, p)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err := c.stop(cfg.KeepLog); err != nil && retErr == nil {
			retErr = fmt.Errorf("stopping containerd: %w", err)
		}
	}()
	ids := map[bool]string{}
	for _, userns := range []bool{true, false} {
		pod, ctr, err := usernsPod(ctx, c, userns)
		if pod != "" {
			defer c.Crictl(context.WithoutCancel(ctx), "rmp", "-f", pod)
		}
		if err != nil {
			return nil, fmt.Errorf("the pod (user namespace %v): %w", userns, err)
		}
		ids[userns] = ctr
	}
	for i := 0; i <= cfg.Runs; i++ {
		var r UsernsRound
		for _, userns := range []bool{true, false} {
			guest, exec, err := runWorkload(ctx, c, ids[userns])
			if err != nil {
				return nil, fmt.Errorf("round %d, user namespace %v: %w", i, userns, err)
			}
			if userns {
				r.Userns, r.UsernsExec = guest, exec
			} else {
				r.Plain, r.PlainExec = guest, exec
			}
		}
		cfg.logf("round %d: in the guest %v with a user namespace, %v without; crictl exec %v, %v", i, r.Userns.Round(10*time.Millisecond), r.Plain.Round(10*time.Millisecond),
			r.UsernsExec.Round(time.Millisecond), r.PlainExec.Round(time.Millisecond))
		if i > 0 {
			rep.Rounds = append(rep.Rounds, r)
		}
	}
	rep.Machine.LoadAfter = report.LoadAvg()
	rep.Finished = time.Now()
	return rep, nil
}

// usernsPod runs a pod, with a user namespace or not, and a sleeping container in it, and
// returns their ids.
func usernsPod(ctx context.Context, c *containerd, userns bool) (pod, ctr string, err error) {
	name := "plain"
	linux := map[string]any{"cgroup_parent": "/" + c.Namespace()}
	sc := map[string]any{}
	if userns {
		name = "userns"
		m := []map[string]any{{"container_id": 0, "host_id": usernsHostID, "length": 65536}}
		sc["namespace_options"] = map[string]any{"userns_options": map[string]any{"mode": 0, "uids": m, "gids": m}}
		linux["security_context"] = sc
	}
	dir := filepath.Join(c.Dir(), "pods", name)
	if err := os.MkdirAll(filepath.Join(dir, "logs"), 0o755); err != nil {
		return "", "", err
	}
	podJSON, ctrJSON := filepath.Join(dir, "pod.json"), filepath.Join(dir, "ctr.json")
	if err := writeJSON(podJSON, map[string]any{"metadata": map[string]any{"name": name, "namespace": "default", "uid": name},
		"log_directory": filepath.Join(dir, "logs"), "linux": linux}); err != nil {
		return "", "", err
	}
	if err := writeJSON(ctrJSON, map[string]any{"metadata": map[string]any{"name": "c"}, "image": map[string]any{"image": criImage},
		"command": []string{"sleep", "3600"}, "log_path": "c.log", "linux": map[string]any{"security_context": sc}}); err != nil {
		return "", "", err
	}
	out, err := c.Crictl(ctx, "runp", "--runtime", HandlerKvfs, podJSON)
	if err != nil {
		return "", "", err
	}
	pod = strings.TrimSpace(out)
	if out, err = c.Crictl(ctx, "create", pod, ctrJSON, podJSON); err != nil {
		return pod, "", err
	}
	ctr = strings.TrimSpace(out)
	if _, err := c.Crictl(ctx, "start", ctr); err != nil {
		return pod, "", err
	}
	// The workload runs as the container's root: check what it is.
	want := "0 0 4294967295"
	if userns {
		want = fmt.Sprintf("0 %d 65536", usernsHostID)
	}
	if out, err = c.Crictl(ctx, "exec", "--sync", ctr, "cat", "/proc/self/uid_map"); err != nil || strings.Join(strings.Fields(out), " ") != want {
		return pod, "", fmt.Errorf("the container's uid_map %q (%v), want %q", out, err, want)
	}
	return pod, ctr, nil
}

// runWorkload runs usernsWorkload in container ctr and returns its time in the guest and
// crictl exec's wall time.
func runWorkload(ctx context.Context, c *containerd, ctr string) (guest, exec time.Duration, err error) {
	t := time.Now()
	out, err := c.Crictl(ctx, "exec", "--sync", "--timeout", "600", ctr, "sh", "-c", usernsWorkload)
	exec = time.Since(t)
	if err != nil {
		return 0, 0, err
	}
	f := strings.Fields(out)
	if len(f) != 3 || f[0] != "uptimes" {
		return 0, 0, fmt.Errorf("the workload's output %q: want uptimes T0 T1", out)
	}
	t0, err0 := strconv.ParseFloat(f[1], 64)
	t1, err1 := strconv.ParseFloat(f[2], 64)
	if err0 != nil || err1 != nil || t1 < t0 {
		return 0, 0, fmt.Errorf("the workload's output %q: bad uptimes", out)
	}
	return time.Duration((t1 - t0) * float64(time.Second)), exec, nil
}

// UsernsSection renders the report as a Markdown section.
func UsernsSection(rep *UsernsReport) string {
	var b strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&b, format, args...) }
	cfg, m := &rep.Config, &rep.Machine
	p("%s\n\n", UsernsSectionHeading)
	p("<!-- Generated by bench/cmd/kvfspodbench -cri -userns (package bench/podbench). Do not edit: run `BENCH_ONLY=userns scripts/bench.sh`. -->\n\n")
	p("What a user namespace (Kubernetes' `hostUsers: false`) costs a kvfs pod's file system. One private containerd with its CRI on runs two pods through the handler `%s` side by side: one with a user namespace (container ids 0-65535 to host ids %d-%d; its root file system's image layers are idmapped mounts on the host, made by containerd's mount code in the shim, and its upper directory is the mapped root's), one without. In each, container root runs the same metadata workload with `crictl exec`: %d files made, listed with `ls -ln`, chmodded and removed; every file of the image listed with `ls -lnR /`; /etc's files chmodded.\n\n",
		HandlerKvfs, usernsHostID, usernsHostID+65535, usernsFiles)
	b.WriteString(report.Command(cfg.Invoked, cfg.Command))
	b.WriteString(report.Date(rep.Started, rep.Finished, ""))
	b.WriteString(report.Machine(m.Host, m.LoadBefore, m.LoadAfter, ""))
	p("- **Versions:** %s; %s; %s; kvfs source %s; guest %s\n", m.Containerd, m.Runc, m.QEMU, orUnknown(cfg.Rev), m.GuestKernel)
	p("- **Accelerator:** %s (%s); vm.memory %s, %d vCPU(s)\n", rep.Accel, rep.AccelWhy, cfg.Memory, cfg.VCPUs)
	p("- **Method:** one uncounted round (the copy-ups, the caches), then %d rounds, each the workload in the user-namespaced pod then in the other. Two readings: the guest's /proc/uptime around the workload (10 ms steps), and `crictl exec --sync`'s wall time on the host (the exec's own cost included, the same in both). Medians with their range; each ratio is the median (range) of the per-round ratios.\n\n", len(rep.Rounds))
	d := func(f func(UsernsRound) time.Duration) []float64 {
		return report.Each(rep.Rounds, func(r UsernsRound) float64 { return f(r).Seconds() })
	}
	rows := []struct {
		label      string
		with, wout []float64
	}{
		{"the workload, in the guest, s", d(func(r UsernsRound) time.Duration { return r.Userns }), d(func(r UsernsRound) time.Duration { return r.Plain })},
		{"`crictl exec --sync` of it, on the host, s", d(func(r UsernsRound) time.Duration { return r.UsernsExec }), d(func(r UsernsRound) time.Duration { return r.PlainExec })},
	}
	guest, exec := Summarize(Ratios(rows[0].with, rows[0].wout)), Summarize(Ratios(rows[1].with, rows[1].wout))
	verdict := "a cost beyond the rounds' noise"
	if guest.Lo <= 1 && guest.Hi >= 1 && exec.Lo <= 1 && exec.Hi >= 1 {
		verdict = "no cost these rounds can tell from their noise: the per-round ratios fall on both sides of 1"
	}
	p("**Reading:** with a user namespace the workload took %s× the plain pod's time in the guest and %s× by `crictl exec`'s clock (medians of the per-round ratios): %s.\n\n",
		fmtNum(guest.Med), fmtNum(exec.Med), verdict)
	p("| | with a user namespace | without | with ÷ without |\n|---|---|---|---|\n")
	for _, row := range rows {
		p("| %s | %s | %s | %s |\n", row.label, Summarize(row.with).Format("%.2f"), Summarize(row.wout).Format("%.2f"), Summarize(Ratios(row.with, row.wout)).Format("%.2f"))
	}
	p("\n")
	return b.String()
}
