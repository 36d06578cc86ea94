package agent

// What the host and the guest agent agree on besides the RPCs: where the share is mounted, how
// the agent is reached, and the kernel command line that tells the agent both.
const (
	// SharedDir is where the agent mounts the pod's virtio-fs share in the guest. A
	// container's root filesystem, bound at mounts/NAME on the host, is SharedDir/NAME here.
	SharedDir = "/run/kvfs/shared"

	// ContainersCgroup is the guest cgroup (below the cgroup2 root) that holds every
	// container's, each at ContainersCgroup/ID: the agent makes it at boot, and its metrics
	// are the pod's (Stats without a container id).
	ContainersCgroup = "/kvfs"

	// SerialPortName is the name of the virtio-serial port that carries the API
	// (-device virtserialport,name=io.kvfs.agent.0); the guest finds it in
	// /sys/class/virtio-ports/*/name.
	SerialPortName = "io.kvfs.agent.0"

	// DefaultVsockPort is the vsock port the agent listens on with the vsock transport.
	DefaultVsockPort = 1024

	// CmdlineTag (kvfs.tag=TAG) is the virtio-fs tag the agent mounts at SharedDir.
	CmdlineTag = "kvfs.tag"
	// CmdlineTransport (kvfs.agent=serial or kvfs.agent=vsock:PORT) chooses the transport;
	// serial is the default.
	CmdlineTransport = "kvfs.agent"
	// CmdlineDebug (kvfs.debug=1) makes the agent log at debug level on the console.
	CmdlineDebug = "kvfs.debug"
)
