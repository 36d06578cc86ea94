module github.com/kvfs/kvfs

go 1.26.8

require (
	github.com/containerd/log v0.2.0
	github.com/sirupsen/logrus v1.10.2
	golang.org/x/sys v0.50.0
)

require golang.org/x/sync v0.25.0

require (
	github.com/containerd/ttrpc v1.2.10
	github.com/google/pprof v0.0.0-20261105003125-4bf881d7fb0b
	github.com/opencontainers/go-digest v1.0.0
	github.com/opencontainers/image-spec v1.1.1
	github.com/pelletier/go-toml/v2 v2.4.3
	google.golang.org/grpc v1.81.1
	google.golang.org/protobuf v1.36.12
)

require google.golang.org/genproto/googleapis/rpc v0.0.0-20260226221140-a57be14db171 // indirect
