# kvfs — see README.md. Every target installs what it needs (scripts/deps.sh) on Debian 12.

GO ?= go
BIN := bin
GUEST := $(or $(KVFS_CACHE),/var/cache/kvfs)/guest

.PHONY: all build deps test test-unit fuzz demo bench vet fmt-check clean generate check-generate

all: build

build:
	$(GO) build -o $(BIN)/ ./cmd/...

deps:
	scripts/deps.sh

vet:
	$(GO) vet ./...

fmt-check:
	@bad=$$(gofmt -l $$(git ls-files '*.go')); \
	if [ -n "$$bad" ]; then echo "gofmt needed:"; echo "$$bad"; exit 1; fi

# How long `make fuzz` runs each fuzz target.
FUZZTIME ?= 2m

# The whole suite: unit tests, the front-end suites against kvfsd and the C virtiofsd, and the
# real guests under QEMU; then every fuzz target for 20 s.
test: deps fmt-check vet
	$(GO) test -race -count=1 -timeout 25m ./...
	FUZZTIME=20s GO=$(GO) scripts/fuzz.sh

# Every fuzz target for FUZZTIME (scripts/fuzz.sh lists them; a crash leaves its input in the
# package's testdata/fuzz to commit with the fix).
fuzz:
	FUZZTIME=$(FUZZTIME) GO=$(GO) scripts/fuzz.sh

# Fast feedback while developing: no guests.
test-unit:
	$(GO) test -short ./...

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
