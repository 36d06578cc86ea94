# kvfs — see README.md. Every target installs what it needs (scripts/deps.sh) on Debian 12.

GO ?= go
BIN := bin
GUEST := $(or $(KVFS_CACHE),/var/cache/kvfs)/guest
# The guest image that install and deb ship: its own directory, so that its KVFS_VERSION does
# not make the tests' agent image (agent-guest, version "devel") rebuild.
DIST_GUEST := $(or $(KVFS_CACHE),/var/cache/kvfs)/dist-guest
VERSION ?= $(shell git describe --tags --always 2>/dev/null || echo devel)

# The install layout (packaging/install.sh): FHS, every part overridable.
DESTDIR ?=
PREFIX ?= /usr/local
SYSCONFDIR ?= /etc
LOCALSTATEDIR ?= /var
LAYOUT = --destdir "$(DESTDIR)" --prefix "$(PREFIX)" --sysconfdir "$(SYSCONFDIR)" --localstatedir "$(LOCALSTATEDIR)"

.PHONY: all build deps guest-kernel k8s test test-k8s test-unit fuzz soak demo bench vet fmt-check clean generate check-generate \
	guest-image install uninstall deb deploy-image

all: build

build:
	$(GO) build -ldflags "-X main.version=$(VERSION)" -o $(BIN)/ ./cmd/...

# The pod VM's guest kernel (packaging/guest/kernel), built once and cached by its inputs: the
# guest images take it from there. make test builds it first, before its tests run side by side.
guest-kernel:
	packaging/guest/kernel/build.sh $(or $(KVFS_CACHE),/var/cache/kvfs)/guest-kernel

# The single-node Kubernetes of the Kubernetes tests (shim/e2e/k8s): etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kubelet and kubectl, built from the Go module proxy
# once (14 CPU-minutes with an empty Go build cache) and cached by their inputs.
k8s:
	internal/testing/k8stest/build/build.sh $(or $(KVFS_CACHE),/var/cache/kvfs)/k8s

# The pod VM's guest image (vmlinux, rootfs.erofs, image.json, SHA256SUMS), reproducible.
guest-image:
	KVFS_VERSION=$(VERSION) packaging/guest/build.sh --agent $(DIST_GUEST)

# Binaries to PREFIX/bin, the guest image to PREFIX/share/kvfs/guest, the configuration to
# SYSCONFDIR/kvfs, containerd's drop-in to SYSCONFDIR/containerd/conf.d; a manifest of it all in
# LOCALSTATEDIR/lib/kvfs, which uninstall follows. A user's edited file is never overwritten.
install: build guest-image
	packaging/install.sh install --bin $(BIN) --guest $(DIST_GUEST) $(LAYOUT)

uninstall:
	packaging/install.sh uninstall $(LAYOUT)

# The Debian package $(BIN)/kvfs_<version>_amd64.deb (packaging/deb/build.sh): make install's
# files under /usr, its configuration a conffile, maintainer scripts that run install.sh.
deb: build guest-image
	packaging/deb/build.sh --bin $(BIN) --guest $(DIST_GUEST) --version $(VERSION) --out $(BIN)

# Kubernetes' node-install image (packaging/kubernetes): the binaries built static, the guest
# image, install.sh and the entrypoint kvfs-deploy, as an OCI archive $(BIN)/kvfs-deploy.tar
# for `ctr --namespace k8s.io image import` on each node (the DaemonSet does not pull it).
DEPLOY_IMAGE ?= localhost/kvfs-deploy:latest
deploy-image: guest-image
	CGO_ENABLED=0 $(GO) build -ldflags "-X main.version=$(VERSION)" -o $(BIN)/static/ \
		./cmd/containerd-shim-kvfs-v2 ./cmd/kvfsd ./cmd/kvfsctl ./packaging/kubernetes/cmd/kvfs-deploy
	$(BIN)/static/kvfs-deploy image -o $(BIN)/kvfs-deploy.tar -name $(DEPLOY_IMAGE) -bin $(BIN)/static -guest $(DIST_GUEST)

deps:
	scripts/deps.sh

# bench/ is a module of its own (its dependencies stay out of the product's go.mod): every
# go command that covers the repository runs in both.
vet:
	$(GO) vet ./...
	cd bench && $(GO) vet ./...

fmt-check:
	@bad=$$(gofmt -l $$(git ls-files '*.go')); \
	if [ -n "$$bad" ]; then echo "gofmt needed:"; echo "$$bad"; exit 1; fi

# How long `make fuzz` runs each fuzz target.
FUZZTIME ?= 2m

# The whole suite: unit tests, the front-end suites against kvfsd and the C virtiofsd, and the
# real guests under QEMU, and the agent's test fault modes (built only with -tags kvfsfaults);
# then every fuzz target for 20 s.
test: deps guest-kernel k8s fmt-check vet
	$(GO) test -race -count=1 -timeout 40m ./...
	cd bench && $(GO) test -race -count=1 -timeout 40m ./...
	$(GO) test -race -count=1 -tags kvfsfaults -run TestFault ./agent/
	FUZZTIME=20s GO=$(GO) scripts/fuzz.sh

# The Kubernetes suite alone: a real single-node cluster, each behaviour for runc and kvfs pods
# (make test runs it with the rest).
test-k8s: deps guest-kernel k8s
	$(GO) test -race -count=1 -timeout 40m -v ./shim/e2e/k8s/

# Every fuzz target for FUZZTIME (scripts/fuzz.sh lists them; a crash leaves its input in the
# package's testdata/fuzz to commit with the fix).
fuzz:
	FUZZTIME=$(FUZZTIME) GO=$(GO) scripts/fuzz.sh

# How long `make soak` runs TestSoak (make test: 30 s); under an hour.
SOAKTIME ?= 5m

# The load test: 16 sandboxes' confined servers with an in-repo front-end each and one server
# with a thread pool and 16 request queues, all at once, for SOAKTIME. Without -race: the race
# detector's own memory would hide whether the servers' RSS stays flat.
soak: deps
	KVFS_SOAK=$(SOAKTIME) $(GO) test -count=1 -timeout 1h -run '^TestSoak$$' -v ./sandbox

# Fast feedback while developing: no guests.
test-unit:
	$(GO) test -short ./...
	cd bench && $(GO) test -short ./...
	$(GO) test -short -tags kvfsfaults -run TestFault ./agent/

demo: deps build
	scripts/demo.sh

bench: deps build
	scripts/bench.sh

# The control API's Go code (api/**/*.pb.go) is generated from its .proto files and committed.
generate: deps
	scripts/gen-api.sh

# Regenerates into a temporary directory and fails if that differs from the committed code
# (`make test` runs the same check as TestGeneratedUpToDate in api/control/v1).
check-generate: deps
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && scripts/gen-api.sh "$$tmp" && \
	cd "$$tmp" && find api -name '*.pb.go' | sort >"$$tmp/.generated" && cd - >/dev/null && \
	find api -name '*.pb.go' | sort | diff -u - "$$tmp/.generated" && \
	while read -r f; do diff -u "$$f" "$$tmp/$$f" || exit 1; done <"$$tmp/.generated"

clean:
	rm -rf $(BIN)
