module github.com/kvfs/kvfs

go 1.26.8

require (
	github.com/containerd/log v0.2.0
	github.com/sirupsen/logrus v1.10.2
	golang.org/x/sys v0.50.0
)

require golang.org/x/sync v0.25.0

require github.com/pelletier/go-toml/v2 v2.4.3
