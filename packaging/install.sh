#!/bin/bash
# Install kvfs on a containerd host, or take it out again.
#
#   packaging/install.sh install   --bin DIR --guest DIR [LAYOUT]   files, then configure
#   packaging/install.sh configure [--packaged] [LAYOUT]            the host's configuration only
#   packaging/install.sh uninstall [--purge] [LAYOUT]               what install or configure added
#   packaging/install.sh stage     --bin DIR --guest DIR [LAYOUT]   a package's files (see below)
#
# LAYOUT options (also read from the environment variables of the same name; options win):
#   --destdir DIR       DESTDIR: a staging root every path below is put under (default none;
#                       install and stage create it)
#   --prefix DIR        PREFIX (default /usr/local)
#   --sysconfdir DIR    SYSCONFDIR (default /etc)
#   --localstatedir DIR LOCALSTATEDIR (default /var)
#
# install copies the binaries in --bin (containerd-shim-kvfs-v2, kvfsd, kvfsctl) to
# PREFIX/bin, the guest image in --guest (vmlinux, rootfs.erofs or initramfs.gz, image.json, SHA256SUMS, as
# packaging/guest/build.sh --agent writes them, checked with sha256sum -c) to
# PREFIX/share/kvfs/guest, this script to PREFIX/share/kvfs/install.sh and the Kata Containers
# fragment (below) to PREFIX/share/kvfs/kata/kvfsd.toml; then configures.
#
# The Kata fragment is for hosts that keep Kata's own shim and want kvfsd as its virtio-fs
# daemon: a [hypervisor.qemu] table naming the installed kvfsd (virtio_fs_daemon,
# valid_virtio_fs_daemon_paths, virtio_fs_extra_args, virtio_fs_cache). Nothing of Kata's is
# changed: the user copies it into the config.d beside the configuration.toml Kata loads.
#
# configure writes
#   SYSCONFDIR/kvfs/configuration.toml      from `kvfsctl config default --guest
#                                           PREFIX/share/kvfs/guest`: every key documented,
#                                           the guest image the installed one
#   SYSCONFDIR/containerd/conf.d/kvfs.toml  the CRI runtime handler "kvfs"
#                                           (io.containerd.kvfs.v2; ConfigPath = the file
#                                           above unless it is the shim's default)
# and, when SYSCONFDIR/containerd/config.toml does not exist, a config.toml that imports
# SYSCONFDIR/containerd/conf.d/*.toml (containerd reads drop-ins only through a config file's
# imports). An existing config.toml is never rewritten: if its imports do not name the drop-in,
# configure says what to add. A file of ours that the user edited is never overwritten: the new
# version goes beside it as FILE.new, and configure says so. Everything configure and install
# add is listed, with its checksum, in the manifest LOCALSTATEDIR/lib/kvfs/install.manifest,
# beside a copy of this script (so that uninstall works once PREFIX is gone, as in a package's
# postrm).
#
# configure --packaged is for a distribution package (the Debian package's postinst): its
# configuration.toml is the package's conffile, which the package manager installs, keeps when
# edited and removes at purge; configure then does only containerd's files and the manifest.
#
# stage writes the files a package ships under DESTDIR, as install does but without the
# manifest or containerd's files: the binaries, the guest image, this script, the Kata
# fragment and configuration.toml.
#
# uninstall removes what the manifest lists, except files edited since (kept, and said so;
# --purge removes them too), and the directories install created once they are empty. A
# second install is idempotent; an upgrade install replaces unedited files.
#
# Every change is printed on stdout. containerd is not restarted: the script says when it
# should be.
set -euo pipefail

prog=install.sh
die() {
	echo "$prog: error: $*" >&2
	exit 1
}
say() {
	echo "$prog: $*"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case $cmd in
install | configure | uninstall | stage) ;;
*) die "usage: $0 install --bin DIR --guest DIR | configure [--packaged] | uninstall [--purge] | stage --bin DIR --guest DIR  [--destdir DIR] [--prefix DIR] [--sysconfdir DIR] [--localstatedir DIR]" ;;
esac

destdir=${DESTDIR:-}
prefix=${PREFIX:-/usr/local}
sysconfdir=${SYSCONFDIR:-/etc}
localstatedir=${LOCALSTATEDIR:-/var}
bindir_src=
guest_src=
purge=
packaged=
while [ $# -gt 0 ]; do
	opt=$1
	case $opt in
	--purge)
		purge=1
		shift
		continue
		;;
	--packaged)
		packaged=1
		shift
		continue
		;;
	--destdir | --prefix | --sysconfdir | --localstatedir | --bin | --guest) ;;
	*) die "unknown option $opt" ;;
	esac
	[ $# -ge 2 ] || die "$opt needs a value"
	case $opt in
	--destdir) destdir=$2 ;;
	--prefix) prefix=$2 ;;
	--sysconfdir) sysconfdir=$2 ;;
	--localstatedir) localstatedir=$2 ;;
	--bin) bindir_src=$2 ;;
	--guest) guest_src=$2 ;;
	esac
	shift 2
done
[ -z "$purge" ] || [ "$cmd" = uninstall ] || die "--purge is for uninstall"
[ -z "$packaged" ] || [ "$cmd" = configure ] || die "--packaged is for configure"
for v in prefix sysconfdir localstatedir; do
	case ${!v} in
	/*) ;;
	*) die "--$v ${!v}: not an absolute path" ;;
	esac
done
case $destdir in
"" | /*) ;;
*) die "--destdir $destdir: not an absolute path" ;;
esac
destdir=${destdir%/}
# install and stage create DESTDIR, once their arguments are checked (install_files); the
# others work on what is there.
[ -z "$destdir" ] || [ -d "$destdir" ] || [ "$cmd" = install ] || [ "$cmd" = stage ] ||
	die "--destdir $destdir: no such directory"

binaries="containerd-shim-kvfs-v2 kvfsd kvfsctl"
# The guest image's files; its root is rootfs.erofs, or initramfs.gz in an image built with
# Debian's kernel (install_files picks).
guest_files="vmlinux rootfs.erofs image.json SHA256SUMS"
share=$prefix/share/kvfs
guest_dir=$share/guest
config=$sysconfdir/kvfs/configuration.toml
kata_fragment=$share/kata/kvfsd.toml
ctrd_dir=$sysconfdir/containerd
dropin=$ctrd_dir/conf.d/kvfs.toml
ctrd_config=$ctrd_dir/config.toml
statedir=$localstatedir/lib/kvfs
manifest=$statedir/install.manifest

# The manifest: one line per file or directory added, "f SHA256 PATH" or "d - PATH", PATH
# without DESTDIR. Directories come before what is in them.
new_manifest=()

# recorded KIND PATH prints the manifest's SHA256 for PATH, empty if it has none.
recorded() {
	[ -f "$destdir$manifest" ] || return 0
	awk -v k="$1" -v p="$2" '$1 == k && substr($0, length($1 $2) + 3) == p { print $2; exit }' "$destdir$manifest"
}

record() {
	local line="$1 $2 $3" l
	for l in "${new_manifest[@]}"; do
		[ "$l" != "$line" ] || return 0
	done
	new_manifest+=("$line")
}

sum() {
	sha256sum <"$1" | cut -d' ' -f1
}

# mkdirs DIR makes DIR and its missing parents, recording those it made, and those made by an
# earlier install, in the manifest.
mkdirs() {
	local d=$1 missing=()
	while [ "$d" != / ] && [ "$d" != . ]; do
		if [ ! -d "$destdir$d" ]; then
			missing=("$d" "${missing[@]}")
		elif [ -n "$(recorded d "$d")" ]; then
			missing=("$d" "${missing[@]}")
		fi
		d=$(dirname "$d")
	done
	for d in "${missing[@]}"; do
		if [ ! -d "$destdir$d" ]; then
			mkdir -m 0755 "$destdir$d" || die "cannot create $destdir$d"
			say "created $destdir$d/"
		fi
		record d - "$d"
	done
}

# copy MODE SRC DEST writes DEST anew as a copy of SRC with MODE: install(1) without its
# options, which busybox (the node-install image's tools) does not have.
copy() {
	rm -f "$3" && cp "$2" "$3" && chmod "$1" "$3"
}

# put SRC DEST MODE installs SRC as DEST: created if missing; replaced if it is what an earlier
# install put there; left alone with the new version beside it as DEST.new if someone else
# wrote it or the user edited it. Recorded in the manifest with the checksum installed.
put() {
	local src=$1 dest=$2 mode=$3 want have was
	want=$(sum "$src")
	mkdirs "$(dirname "$dest")"
	was=$(recorded f "$dest")
	if [ ! -e "$destdir$dest" ]; then
		copy "$mode" "$src" "$destdir$dest" || die "cannot install $destdir$dest"
		say "installed $destdir$dest"
		record f "$want" "$dest"
		return
	fi
	have=$(sum "$destdir$dest")
	if [ "$have" = "$want" ]; then
		chmod "$mode" "$destdir$dest"
		# Ours if recorded; a file someone else wrote with the same contents stays theirs.
		[ -z "$was" ] || record f "$want" "$dest"
		return
	fi
	if [ -n "$was" ] && [ "$have" = "$was" ]; then
		copy "$mode" "$src" "$destdir$dest.tmp" && mv -f "$destdir$dest.tmp" "$destdir$dest" ||
			die "cannot replace $destdir$dest"
		say "updated $destdir$dest"
		record f "$want" "$dest"
		return
	fi
	# Edited since we installed it, or not ours: keep it.
	[ -z "$was" ] || record f "$was" "$dest"
	copy "$mode" "$src" "$destdir$dest.new" || die "cannot install $destdir$dest.new"
	record f "$want" "$dest.new"
	if [ -n "$was" ]; then
		say "kept $destdir$dest: edited since it was installed; the new version is $destdir$dest.new (compare, merge, then remove it)"
	else
		say "kept $destdir$dest: not installed by kvfs; ours is $destdir$dest.new (compare, merge, then remove it)"
	fi
}

# A .new written by an earlier install that is not needed any more (the file it stood beside
# was merged or removed) stays in the manifest, so that uninstall takes it out.
keep_stale_news() {
	local kind s path
	[ -f "$destdir$manifest" ] || return 0
	while read -r kind s path; do
		[ "$kind" = f ] && [ "${path%.new}" != "$path" ] && [ -e "$destdir$path" ] || continue
		[ "$(sum "$destdir$path")" = "$s" ] && record f "$s" "$path"
	done <"$destdir$manifest"
}

write_manifest() {
	local l
	mkdirs "$statedir"
	put "$0" "$statedir/install.sh" 0755
	{
		for l in "${new_manifest[@]}"; do
			echo "$l"
		done
	} >"$destdir$manifest.tmp" && mv -f "$destdir$manifest.tmp" "$destdir$manifest" ||
		die "cannot write $destdir$manifest"
	say "recorded ${#new_manifest[@]} entries in $destdir$manifest"
}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

install_files() {
	local b f
	[ -n "$bindir_src" ] || die "install needs --bin DIR (the built binaries: $binaries)"
	[ -n "$guest_src" ] || die "install needs --guest DIR (packaging/guest/build.sh --agent DIR)"
	for b in $binaries; do
		[ -x "$bindir_src/$b" ] || die "no executable $bindir_src/$b (make build)"
	done
	[ -f "$guest_src/rootfs.erofs" ] || [ ! -f "$guest_src/initramfs.gz" ] ||
		guest_files="vmlinux initramfs.gz image.json SHA256SUMS"
	for f in $guest_files; do
		[ -f "$guest_src/$f" ] || die "no $guest_src/$f (packaging/guest/build.sh --agent $guest_src)"
	done
	# -c without --quiet, which busybox's sha256sum (the node-install image's) does not know.
	if ! (cd "$guest_src" && sha256sum -c SHA256SUMS) >"$tmp/sums" 2>&1; then
		grep -v ': OK$' "$tmp/sums" >&2
		die "$guest_src: the guest image does not match its SHA256SUMS"
	fi
	if [ -n "$destdir" ] && [ ! -d "$destdir" ]; then
		mkdir -p "$destdir" || die "cannot create --destdir $destdir"
		say "created $destdir/"
	fi
	for b in $binaries; do
		put "$bindir_src/$b" "$prefix/bin/$b" 0755
	done
	for f in $guest_files; do
		put "$guest_src/$f" "$guest_dir/$f" 0644
	done
	put "$0" "$share/install.sh" 0755

	# Kata appends virtio_fs_extra_args to its own arguments (the Go runtime: --syslog --cache
	# --shared-dir --fd; runtime-rs: --socket-path --shared-dir --cache --sandbox none
	# --seccomp none), and kvfsd takes the last of a repeated option: --sandbox and --seccomp
	# here keep kvfsd confined under runtime-rs too.
	cat >"$tmp/kvfsd.toml" <<-EOF
		# kvfsd as the virtio-fs daemon of Kata Containers 3.x's QEMU hypervisor (the Go runtime
		# and runtime-rs). Installed by $share/install.sh; removed by its uninstall.
		# To use it, copy it into the config.d directory beside the configuration.toml your
		# Kata runtime loads (Kata merges config.d/*.toml over it in name order), e.g.
		#   cp $kata_fragment /opt/kata/share/defaults/kata-containers/config.d/50-kvfsd.toml
		# and remove that copy to go back to Kata's virtiofsd. shared_fs must be virtio-fs.
		[hypervisor.qemu]
		virtio_fs_daemon = "$prefix/bin/kvfsd"
		valid_virtio_fs_daemon_paths = ["$prefix/bin/kvfsd"]
		virtio_fs_extra_args = ["--thread-pool-size=1", "--announce-submounts", "--sandbox=namespace", "--seccomp=kill"]
		virtio_fs_cache = "auto"
	EOF
	put "$tmp/kvfsd.toml" "$kata_fragment" 0644
}

# render_config writes configuration.toml: DefaultConfig() with the installed guest image.
render_config() {
	local kvfsctl=$destdir$prefix/bin/kvfsctl
	[ -x "$kvfsctl" ] || die "no $kvfsctl: install the files first (install --bin --guest)"
	"$kvfsctl" config default --guest "$guest_dir" >"$tmp/configuration.toml" ||
		die "$kvfsctl config default failed"
	put "$tmp/configuration.toml" "$config" 0644
}

# imports_dropin says whether containerd's config.toml imports the drop-in: its top-level
# imports array (before any table) names conf.d/*.toml or the drop-in itself.
imports_dropin() {
	awk -v glob="$ctrd_dir/conf.d/*.toml" -v file="$dropin" '
		/^[ \t]*\[/ { exit }
		/^[ \t]*imports[ \t]*=/ { on = 1 }
		on { s = s $0; if ($0 ~ /\]/) exit }
		END {
			n = split(s, parts, /["\047]/)
			for (i = 2; i <= n; i += 2) if (parts[i] == glob || parts[i] == file) found = 1
			exit !found
		}' "$1"
}

configure() {
	keep_stale_news
	[ -n "$packaged" ] || render_config

	cat >"$tmp/kvfs.toml" <<-EOF
		# The kvfs runtime for containerd 2.x's CRI: pods with runtimeClassName kvfs (handler
		# kvfs) run in a VM. Installed by $share/install.sh; removed by its uninstall.
		version = 3

		[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.kvfs]
		  runtime_type = 'io.containerd.kvfs.v2'
		  runtime_path = '$prefix/bin/containerd-shim-kvfs-v2'
		  sandboxer = 'podsandbox'
		  # The sandbox configuration's annotations (io.kvfs.config.*) reach the shim; which
		  # of them a pod may set is the configuration's [annotations] enabled.
		  pod_annotations = ['io.kvfs.config.*']
	EOF
	# No options where the configuration is the shim's default: containerd's CRI (2.4) gives
	# a user-namespaced pod's tasks runc's options, and fails on a handler whose options are
	# of another type (ConfigPath's). Elsewhere ConfigPath names it, and such pods fail.
	if [ "$config" != /etc/kvfs/configuration.toml ]; then
		cat >>"$tmp/kvfs.toml" <<-EOF

			  # The shim's default is /etc/kvfs/configuration.toml. With these options,
			  # containerd's CRI cannot run user-namespaced pods (hostUsers: false) here.
			  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.kvfs.options]
			    ConfigPath = '$config'
		EOF
	fi
	put "$tmp/kvfs.toml" "$dropin" 0644

	if [ ! -e "$destdir$ctrd_config" ] || [ -n "$(recorded f "$ctrd_config")" ]; then
		cat >"$tmp/config.toml" <<-EOF
			# containerd's configuration: its defaults, and the drop-ins in conf.d. Written by
			# kvfs's $share/install.sh because there was none; removed by its uninstall unless
			# edited.
			version = 3
			imports = ['$ctrd_dir/conf.d/*.toml']
		EOF
		put "$tmp/config.toml" "$ctrd_config" 0644
	elif ! imports_dropin "$destdir$ctrd_config"; then
		say "NOTE: $destdir$ctrd_config does not import $dropin, and is not rewritten: add"
		say "        imports = [\"$ctrd_dir/conf.d/*.toml\"]"
		say "      at its top (before any [table]; keep the imports it has), then restart containerd"
	fi
	write_manifest
	say "done; restart containerd (systemctl restart containerd) to load the kvfs runtime"
}

# state_path PATH says whether PATH is the state directory, one of its parents or in it: those
# go last, after the manifest.
state_path() {
	case $statedir/ in "$1"/*) return 0 ;; esac
	case $1 in "$statedir"/*) return 0 ;; esac
	return 1
}

uninstall() {
	local kind s path line kept_f=() kept_d=() state_d=() lines=() i
	[ -f "$destdir$manifest" ] || die "no $destdir$manifest: nothing installed here (or a different --destdir/--localstatedir)"
	mapfile -t lines <"$destdir$manifest"
	for line in "${lines[@]}"; do
		read -r kind s path <<<"$line"
		[ "$kind" = f ] && ! state_path "$path" && [ -e "$destdir$path" ] || continue
		if [ "$(sum "$destdir$path")" != "$s" ] && [ -z "$purge" ]; then
			say "kept $destdir$path: edited since it was installed (uninstall --purge removes it)"
			kept_f+=("$line")
			continue
		fi
		rm -f "$destdir$path" || die "cannot remove $destdir$path"
		say "removed $destdir$path"
	done
	# Directories deepest first; those holding a kept file stay.
	for ((i = ${#lines[@]} - 1; i >= 0; i--)); do
		read -r kind s path <<<"${lines[i]}"
		[ "$kind" = d ] || continue
		if state_path "$path"; then
			state_d=("${lines[i]}" "${state_d[@]}")
			continue
		fi
		if [ ${#kept_f[@]} -gt 0 ] && printf '%s\n' "${kept_f[@]}" | grep -qF " $path/"; then
			kept_d=("${lines[i]}" "${kept_d[@]}")
			continue
		fi
		if rmdir "$destdir$path" 2>/dev/null; then
			say "removed $destdir$path/"
		elif [ -d "$destdir$path" ]; then
			say "left $destdir$path/: it holds files kvfs did not install"
		fi
	done
	if [ ${#kept_f[@]} -gt 0 ]; then
		# What is left stays listed, for uninstall --purge, with the copy of this script.
		printf '%s\n' "${state_d[@]}" "${kept_d[@]}" "${kept_f[@]}" \
			"$(grep -F " $statedir/install.sh" "$destdir$manifest" | grep '^f ')" >"$destdir$manifest.tmp" &&
			mv -f "$destdir$manifest.tmp" "$destdir$manifest" || die "cannot write $destdir$manifest"
		say "kept ${#kept_f[@]} edited files, listed in $destdir$manifest"
		return
	fi
	rm -f "$destdir$statedir/install.sh" "$destdir$manifest" || die "cannot remove $destdir$manifest"
	say "removed $destdir$manifest"
	for ((i = ${#state_d[@]} - 1; i >= 0; i--)); do
		read -r kind s path <<<"${state_d[i]}"
		rmdir "$destdir$path" 2>/dev/null && say "removed $destdir$path/" || true
	done
	say "done; restart containerd if it had loaded the kvfs runtime"
}

case $cmd in
install)
	install_files
	configure
	;;
configure) configure ;;
uninstall) uninstall ;;
stage)
	install_files
	render_config
	;;
esac
