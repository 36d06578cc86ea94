// Package kubernetes_test checks the Kubernetes manifests in this directory against the
// Kubernetes API's types (k8s.io/api, the version go.mod pins): each document decodes
// strictly, an unknown or misspelt field being an error, and what refers to what (selector
// and labels, service account and RBAC, volumes and mounts, the node label the RuntimeClass
// selects and the installer sets) holds together.
package kubernetes_test

import (
	"bytes"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	nodev1 "k8s.io/api/node/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/validation"
	"sigs.k8s.io/yaml"
)

// The image make deploy-image builds, and the label kvfs-deploy sets by default.
const (
	image     = "localhost/kvfs-deploy:latest"
	nodeLabel = "kvfs.io/kvfs-runtime"
)

// decode splits file into its YAML documents and decodes each strictly into the type its
// apiVersion and kind name.
func decode(t *testing.T, file string) []any {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var objs []any
	for i, doc := range regexp.MustCompile(`(?m)^---\s*$`).Split(string(data), -1) {
		if len(bytes.TrimSpace([]byte(stripComments(doc)))) == 0 {
			continue
		}
		var tm metav1.TypeMeta
		if err := yaml.Unmarshal([]byte(doc), &tm); err != nil {
			t.Fatalf("%s, document %d: %v", file, i+1, err)
		}
		var obj any
		switch tm.APIVersion + " " + tm.Kind {
		case "node.k8s.io/v1 RuntimeClass":
			obj = &nodev1.RuntimeClass{}
		case "apps/v1 DaemonSet":
			obj = &appsv1.DaemonSet{}
		case "v1 ServiceAccount":
			obj = &corev1.ServiceAccount{}
		case "rbac.authorization.k8s.io/v1 ClusterRole":
			obj = &rbacv1.ClusterRole{}
		case "rbac.authorization.k8s.io/v1 ClusterRoleBinding":
			obj = &rbacv1.ClusterRoleBinding{}
		default:
			t.Fatalf("%s, document %d: unexpected apiVersion %q kind %q", file, i+1, tm.APIVersion, tm.Kind)
		}
		if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
			t.Fatalf("%s, document %d (%s): %v", file, i+1, tm.Kind, err)
		}
		checkMeta(t, file, obj)
		objs = append(objs, obj)
	}
	return objs
}

func stripComments(doc string) string {
	var b strings.Builder
	for _, l := range strings.Split(doc, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(l), "#") {
			b.WriteString(l + "\n")
		}
	}
	return b.String()
}

// checkMeta checks an object's name, namespace and labels as the API server would.
func checkMeta(t *testing.T, file string, obj any) {
	t.Helper()
	m := obj.(metav1.Object)
	for _, e := range validation.IsDNS1123Subdomain(m.GetName()) {
		t.Errorf("%s: name %q: %s", file, m.GetName(), e)
	}
	if ns := m.GetNamespace(); ns != "" {
		for _, e := range validation.IsDNS1123Label(ns) {
			t.Errorf("%s: namespace %q: %s", file, ns, e)
		}
	}
	checkLabels(t, file+": "+m.GetName()+"'s labels", m.GetLabels())
}

func checkLabels(t *testing.T, what string, l map[string]string) {
	t.Helper()
	for k, v := range l {
		for _, e := range validation.IsQualifiedName(k) {
			t.Errorf("%s: key %q: %s", what, k, e)
		}
		for _, e := range validation.IsValidLabelValue(v) {
			t.Errorf("%s: value %q: %s", what, v, e)
		}
	}
}

func TestRuntimeClass(t *testing.T) {
	objs := decode(t, "runtimeclass.yaml")
	if len(objs) != 1 {
		t.Fatalf("runtimeclass.yaml: %d objects, want 1", len(objs))
	}
	rc, ok := objs[0].(*nodev1.RuntimeClass)
	if !ok {
		t.Fatalf("runtimeclass.yaml: %T, want a RuntimeClass", objs[0])
	}
	// The handler is the CRI runtime name install.sh's drop-in registers.
	dropin, err := os.ReadFile("../install.sh")
	if err != nil {
		t.Fatal(err)
	}
	if rc.Name != "kvfs" || rc.Handler != "kvfs" || !strings.Contains(string(dropin), "containerd.runtimes."+rc.Handler+"]") {
		t.Errorf("RuntimeClass %q handler %q: want kvfs, the drop-in's runtime", rc.Name, rc.Handler)
	}
	for _, e := range validation.IsDNS1123Label(rc.Handler) {
		t.Errorf("handler %q: %s", rc.Handler, e)
	}
	if rc.Overhead == nil {
		t.Fatal("no overhead")
	}
	for _, r := range []corev1.ResourceName{corev1.ResourceMemory, corev1.ResourceCPU} {
		q, ok := rc.Overhead.PodFixed[r]
		if !ok || q.Sign() <= 0 {
			t.Errorf("overhead.podFixed %s: %v (set %t), want a positive quantity", r, &q, ok)
		}
	}
	if len(rc.Overhead.PodFixed) != 2 {
		t.Errorf("overhead.podFixed %v: want memory and cpu only", rc.Overhead.PodFixed)
	}
	data, _ := os.ReadFile("runtimeclass.yaml")
	if !strings.Contains(string(data), "BENCH_ONLY=cri") {
		t.Errorf("runtimeclass.yaml does not give the command that measured its overhead")
	}
	if rc.Scheduling == nil || rc.Scheduling.NodeSelector[nodeLabel] != "true" {
		t.Errorf("scheduling.nodeSelector: %+v, want %s=true (the label kvfs-deploy sets)", rc.Scheduling, nodeLabel)
	} else {
		checkLabels(t, "scheduling.nodeSelector", rc.Scheduling.NodeSelector)
	}
}

// entrypointEnv are the environment variables kvfs-deploy reads, from its source.
func entrypointEnv(t *testing.T) []string {
	t.Helper()
	src, err := os.ReadFile("cmd/kvfs-deploy/main.go")
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, m := range regexp.MustCompile(`env(?:Bool)?\("([A-Z_]+)"`).FindAllStringSubmatch(string(src), -1) {
		names = append(names, m[1])
	}
	if len(names) < 5 {
		t.Fatalf("found only %q in kvfs-deploy's source", names)
	}
	return names
}

func TestDeploy(t *testing.T) {
	objs := decode(t, "kvfs-deploy.yaml")
	var (
		sa   *corev1.ServiceAccount
		role *rbacv1.ClusterRole
		bind *rbacv1.ClusterRoleBinding
		ds   *appsv1.DaemonSet
	)
	for _, o := range objs {
		switch o := o.(type) {
		case *corev1.ServiceAccount:
			sa = o
		case *rbacv1.ClusterRole:
			role = o
		case *rbacv1.ClusterRoleBinding:
			bind = o
		case *appsv1.DaemonSet:
			ds = o
		}
	}
	if sa == nil || role == nil || bind == nil || ds == nil || len(objs) != 4 {
		t.Fatalf("kvfs-deploy.yaml: %d objects, want a ServiceAccount, a ClusterRole, a ClusterRoleBinding and a DaemonSet", len(objs))
	}
	patchesNodes := false
	for _, r := range role.Rules {
		if slices.Contains(r.APIGroups, "") && slices.Contains(r.Resources, "nodes") && slices.Contains(r.Verbs, "patch") {
			patchesNodes = true
		}
		if len(r.ResourceNames) == 0 && (slices.Contains(r.Verbs, "*") || slices.Contains(r.Resources, "*")) {
			t.Errorf("ClusterRole rule %+v: wider than patching nodes", r)
		}
	}
	if !patchesNodes {
		t.Errorf("ClusterRole %s does not allow patching nodes: %+v", role.Name, role.Rules)
	}
	if bind.RoleRef != (rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role.Name}) {
		t.Errorf("ClusterRoleBinding roleRef %+v, want ClusterRole %s", bind.RoleRef, role.Name)
	}
	if !slices.Contains(bind.Subjects, rbacv1.Subject{Kind: rbacv1.ServiceAccountKind, Name: sa.Name, Namespace: sa.Namespace}) {
		t.Errorf("ClusterRoleBinding subjects %+v: not ServiceAccount %s/%s", bind.Subjects, sa.Namespace, sa.Name)
	}
	checkDaemonSet(t, ds, sa, "install", entrypointEnv(t))

	cleanup := decode(t, "kvfs-cleanup.yaml")
	if len(cleanup) != 1 {
		t.Fatalf("kvfs-cleanup.yaml: %d objects, want one DaemonSet", len(cleanup))
	}
	cds, ok := cleanup[0].(*appsv1.DaemonSet)
	if !ok {
		t.Fatalf("kvfs-cleanup.yaml: %T, want a DaemonSet", cleanup[0])
	}
	if cds.Name == ds.Name {
		t.Errorf("the cleanup DaemonSet has the install's name %s", ds.Name)
	}
	checkDaemonSet(t, cds, sa, "uninstall", entrypointEnv(t))
	// Both install and uninstall into the same layout.
	if a, b := envOf(ds.Spec.Template.Spec.Containers[0]), envOf(cds.Spec.Template.Spec.Containers[0]); a["KVFS_PREFIX"] != b["KVFS_PREFIX"] ||
		a["KVFS_HOST_ROOT"] != b["KVFS_HOST_ROOT"] || a["KVFS_RESTART_CONTAINERD"] != b["KVFS_RESTART_CONTAINERD"] {
		t.Errorf("install's environment %v and uninstall's %v differ in layout or restart", a, b)
	}
}

func envOf(c corev1.Container) map[string]string {
	m := map[string]string{}
	for _, e := range c.Env {
		m[e.Name] = e.Value
	}
	return m
}

func checkDaemonSet(t *testing.T, ds *appsv1.DaemonSet, sa *corev1.ServiceAccount, command string, known []string) {
	t.Helper()
	what := "DaemonSet " + ds.Name
	if ds.Namespace != sa.Namespace {
		t.Errorf("%s: namespace %q, its ServiceAccount's %q", what, ds.Namespace, sa.Namespace)
	}
	sel, err := metav1.LabelSelectorAsSelector(ds.Spec.Selector)
	if err != nil || sel.Empty() {
		t.Fatalf("%s: selector %+v: %v", what, ds.Spec.Selector, err)
	}
	if !sel.Matches(labels.Set(ds.Spec.Template.Labels)) {
		t.Errorf("%s: selector %s does not match the template's labels %v (the API server refuses it)", what, sel, ds.Spec.Template.Labels)
	}
	checkLabels(t, what+"'s template labels", ds.Spec.Template.Labels)
	checkLabels(t, what+"'s nodeSelector", ds.Spec.Template.Spec.NodeSelector)
	pod := ds.Spec.Template.Spec
	if pod.ServiceAccountName != sa.Name {
		t.Errorf("%s: serviceAccountName %q, want %q", what, pod.ServiceAccountName, sa.Name)
	}
	if !pod.HostPID {
		t.Errorf("%s: no hostPID: the restart command enters PID 1's mount namespace", what)
	}
	if len(pod.Containers) != 1 {
		t.Fatalf("%s: %d containers, want 1", what, len(pod.Containers))
	}
	c := pod.Containers[0]
	if c.Image != image || c.ImagePullPolicy != corev1.PullNever {
		t.Errorf("%s: image %q pull %q, want %q (make deploy-image, imported on the node) pull Never", what, c.Image, c.ImagePullPolicy, image)
	}
	if !slices.Equal(c.Args, []string{command}) || len(c.Command) != 0 {
		t.Errorf("%s: command %q args %q, want the image's entrypoint with %q", what, c.Command, c.Args, command)
	}
	if c.SecurityContext == nil || c.SecurityContext.Privileged == nil || !*c.SecurityContext.Privileged {
		t.Errorf("%s: not privileged (it writes the host's root and enters its mount namespace)", what)
	}
	env := envOf(c)
	for _, e := range c.Env {
		if !slices.Contains(known, e.Name) {
			t.Errorf("%s: environment variable %s: kvfs-deploy reads none such (it reads %q)", what, e.Name, known)
		}
		if e.Name == "NODE_NAME" && (e.ValueFrom == nil || e.ValueFrom.FieldRef == nil || e.ValueFrom.FieldRef.FieldPath != "spec.nodeName") {
			t.Errorf("%s: NODE_NAME is not the downward API's spec.nodeName: %+v", what, e)
		}
	}
	if !strings.HasPrefix(env["KVFS_RESTART_CONTAINERD"], "nsenter --target 1 --mount -- ") {
		t.Errorf("%s: KVFS_RESTART_CONTAINERD %q does not enter the host's mount namespace", what, env["KVFS_RESTART_CONTAINERD"])
	}
	volumes := map[string]corev1.Volume{}
	for _, v := range pod.Volumes {
		volumes[v.Name] = v
	}
	hostRoot := false
	for _, m := range c.VolumeMounts {
		v, ok := volumes[m.Name]
		if !ok {
			t.Errorf("%s: volumeMount %s names no volume", what, m.Name)
			continue
		}
		if v.HostPath != nil && v.HostPath.Path == "/" && m.MountPath == env["KVFS_HOST_ROOT"] && !m.ReadOnly {
			hostRoot = true
		}
	}
	if !hostRoot {
		t.Errorf("%s: the node's / is not mounted writable at KVFS_HOST_ROOT %q", what, env["KVFS_HOST_ROOT"])
	}
}
