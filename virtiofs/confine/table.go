package confine

// sc is an allowed call without an argument check.
func sc(name string, nr uintptr) Syscall { return Syscall{Name: name, Nr: nr, ArgValue: -1} }

// scArg is an allowed call whose argument number arg (from 0) must be value.
func scArg(name string, nr uintptr, arg int, value uint32) Syscall {
	return Syscall{Name: name, Nr: nr, ArgIndex: arg, ArgValue: int64(value)}
}

// table builds the allowlist from group names, each followed by its calls.
func table(items ...any) []Syscall {
	var out []Syscall
	group := ""
	for _, it := range items {
		switch v := it.(type) {
		case string:
			group = v
		case Syscall:
			v.Group = group
			out = append(out, v)
		default:
			panic("confine: bad allowlist item")
		}
	}
	return out
}

// fsIocFsgetxattr is FS_IOC_FSGETXATTR, _IOR('X', 31, struct fsxattr), the same on every
// architecture kvfsd builds for; x/sys/unix does not name it. passthrough's dax.go makes the
// call.
const fsIocFsgetxattr = 0x801c581f
