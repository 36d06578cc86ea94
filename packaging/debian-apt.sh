# Debian packages of another suite (trixie, bookworm-backports) without touching the
# machine's apt: sourced by scripts/deps.sh, packaging/guest/build.sh and
# packaging/guest/kernel/build.sh. The machine's sources, lists and installed packages stay
# as they are; the packages are only downloaded or unpacked.

# debian_download SUITE DIR PACKAGE...: downloads the packages of Debian's SUITE into DIR
# with a private apt state, made for the call and removed after it.
debian_download() {
	local suite=$1 dir=$2 state status=0
	shift 2
	state=$(mktemp -d "${TMPDIR:-/tmp}/kvfs-apt.XXXXXX")
	mkdir -p "$state/lists/partial" "$state/cache/archives/partial"
	echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $suite main" >"$state/sources.list"
	local apt_private=(-o "Dir::Etc::sourcelist=$state/sources.list" -o Dir::Etc::sourceparts=- -o "Dir::State::Lists=$state/lists"
		-o "Dir::Cache=$state/cache" -o APT::Sandbox::User=root)
	apt-get -q "${apt_private[@]}" update >/dev/null &&
		(cd "$dir" && apt-get -q "${apt_private[@]}" download "$@" >/dev/null) || status=$?
	rm -rf "$state"
	return $status
}

# unpack_debs SUITE ROOT PACKAGE...: downloads the packages of Debian's SUITE and unpacks them
# into ROOT, which replaces what was there once all of them are unpacked.
unpack_debs() {
	local suite=$1 root=$2 tmp
	shift 2
	mkdir -p "${root%/*}"
	tmp=$(mktemp -d "${root%/*}/.unpack.XXXXXX")
	trap 'rm -rf "$tmp"' EXIT
	mkdir -p "$tmp/debs" "$tmp/root"
	debian_download "$suite" "$tmp/debs" "$@"
	for deb in "$tmp"/debs/*.deb; do
		dpkg-deb -x "$deb" "$tmp/root"
	done
	rm -rf "$root"
	mv "$tmp/root" "$root"
	rm -rf "$tmp"
	trap - EXIT
}
