// Command etcd is etcd's server, built here from go.etcd.io/etcd/server/v3 at the version
// k8s.io/kubernetes requires, for the Kubernetes node of kvfs's tests (k8stest).
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
