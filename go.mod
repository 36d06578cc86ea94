module github.com/kvfs/kvfs

go 1.26.8

require (
	github.com/containerd/log v0.2.0
	github.com/sirupsen/logrus v1.10.2
	golang.org/x/sys v0.50.0
)

require golang.org/x/sync v0.25.0

require (
	github.com/containerd/cgroups/v3 v3.1.3
	github.com/containerd/console v1.0.5
	github.com/containerd/go-runc v1.2.1
	github.com/containerd/ttrpc v1.2.10
	github.com/containerd/typeurl/v2 v2.3.0
	github.com/google/pprof v0.0.0-20261105003125-4bf881d7fb0b
	github.com/mdlayher/vsock v1.3.0
	github.com/opencontainers/runtime-spec v1.3.0
	github.com/pelletier/go-toml/v2 v2.4.3
	google.golang.org/grpc v1.81.1
	google.golang.org/protobuf v1.36.12
)

require (
	github.com/cilium/ebpf v0.16.0 // indirect
	github.com/coreos/go-systemd/v22 v22.5.0 // indirect
	github.com/godbus/dbus/v5 v5.1.0 // indirect
	github.com/mdlayher/socket v0.6.0 // indirect
	golang.org/x/exp v0.0.0-20241108190413-2d47ceb2692f // indirect
	golang.org/x/net v0.55.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260226221140-a57be14db171 // indirect
)
