// Package shim is containerd-shim-kvfs-v2 (runtime io.containerd.kvfs.v2): containerd's task
// API (v3, over ttrpc) for the containers of one pod, run by the kvfs guest agent in the pod's
// QEMU VM, their files served to the guest over virtio-fs by the sandbox's kvfsd, confined in
// a process of its own (package sandbox/confined: the shim's main calls confined.Init first).
//
// # Pieces
//
//   - Manager is the bootstrap side (containerd v2.4's pkg/shim.Shim, driven by RunShim): the
//     start action groups containers by pod (SandboxID: CRI's io.kubernetes.cri.sandbox-id,
//     or the container's own id for ctr and nerdctl) into one long-lived shim process per pod,
//     on a socket named after the pod; the delete action (Cleanup) undoes what a dead shim
//     left: the rootfs mount and the sandbox (VM killed, mounts detached, directory removed).
//   - Service is the task API. The first Create makes and boots the pod (a PodStarter:
//     StartVMPod in production), the last Delete stops it, Shutdown with no container left
//     ends the shim.
//   - Pod is the narrow interface to the VM: the agent (api/agent/v1), the share's Bind and
//     Unbind, and the pod's death. VMPod is the real one: a sandbox.Sandbox booted with
//     sandbox.DefaultVM, the agent dialled on agent.sock (virtio-serial) or vsock until it
//     answers Ping within agent.boot_timeout, and the sandbox's control API served on
//     control.sock in the sandbox directory.
//   - AdaptSpec turns a container's OCI spec into the guest's: its root under
//     /run/kvfs/shared/<id>, host-only parts dropped, host bind mounts bound into the share.
//   - Package stdio opens containerd's stdio (fifos, file://, binary://).
//
// # Processes and exits
//
// A process (a container's init, or an exec) is a state machine (process.go): created,
// starting, running, paused, stopped, deleted; an operation in a state that does not allow it
// is errdefs.ErrFailedPrecondition, except a Kill of a finished process, which is
// errdefs.ErrNotFound as in runc's shim (containerd's callers take it as "already dead").
// Each process's exit follows one order on every path (normal exit, kill, the VM's death):
// its output read from the agent to EOF and written to containerd's streams, the streams
// closed, the exit recorded, TaskExit published, then Wait returns. An init's TaskExit comes
// after its running execs'. If the VM or the virtio-fs server dies, every process ends with
// exit status 255 and a TaskExit, and the log says why. Events are published in the order the
// API promises: TaskCreate before TaskStart before TaskExit before TaskDelete.
//
// # Locks
//
// Service.mu guards the container map and the pod; container.mu a container's execs;
// process.mu a process's state. Order: Service.mu, then container.mu, then process.mu; none
// is held across a call to the agent, the VM, the sandbox, a mount or the publisher. The
// first Create boots the pod with no lock held; concurrent Creates wait on a channel.
//
// # Threat model
//
// The guest is hostile to the host: everything the agent answers is untrusted. The shim only
// copies the guest's output (bounded per read: an answer larger than asked ends the stream),
// takes its pids and exit statuses as numbers, and bounds every wait on it (the drain of a
// process's output after its exit, the execs' exits before an init's, the boot). The guest
// never names a host path: the shim decides every bind (AdaptSpec), and the sandbox package
// never follows the guest's symlinks when it unbinds and cleans up. containerd, its
// requests and the configuration file are trusted; a pod's annotations are not (see
// sandbox.Config.Resolve).
package shim
