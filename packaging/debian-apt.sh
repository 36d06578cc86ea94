# Debian packages: the machine's own (apt_run, install_missing), and another suite's
# (trixie, bookworm-backports) without touching the machine's apt (debian_download,
# unpack_debs: the machine's sources, lists and installed packages stay as they are; the
# packages are only downloaded or unpacked). Sourced by scripts/deps.sh,
# packaging/guest/build.sh and packaging/guest/kernel/build.sh.

apt_lists_present() {
	compgen -G '/var/lib/apt/lists/*_Packages*' >/dev/null
}

apt_updated=
apt_update() {
	[ -z "$apt_updated" ] || return 0
	echo "apt-get update" >&2
	apt-get update -q >&2 || return 1
	apt_updated=1
}

# apt_run ARGS... runs the machine's apt-get ARGS, refreshing the package lists first when
# there are none and once more when the command fails.
apt_run() {
	apt_lists_present || apt_update || return 1
	if ! DEBIAN_FRONTEND=noninteractive apt-get -q "$@" >&2; then
		[ -z "$apt_updated" ] || return 1
		apt_update || return 1
		DEBIAN_FRONTEND=noninteractive apt-get -q "$@" >&2
	fi
}

# install_missing PROG PACKAGE...: installs those of the packages the machine lacks (as root),
# or exits naming them, PROG first.
install_missing() {
	local prog=$1 p missing=()
	shift
	for p in "$@"; do
		[ "$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null)" = installed ] || missing+=("$p")
	done
	[ ${#missing[@]} -gt 0 ] || return 0
	if [ "$(id -u)" != 0 ]; then
		echo "$prog: error: missing packages ${missing[*]}; run as root or install them" >&2
		exit 1
	fi
	echo "$prog: installing ${missing[*]}" >&2
	if ! apt_run install -y --no-install-recommends "${missing[@]}"; then
		echo "$prog: error: apt-get install ${missing[*]} failed" >&2
		exit 1
	fi
}

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
