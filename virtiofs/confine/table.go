package confine

// sc is an allowed call without an argument check.
func sc(name string, nr uintptr) Syscall { return Syscall{Name: name, Nr: nr, AF: -1} }

// scAF is an allowed call whose first argument must be af.
func scAF(name string, nr uintptr, af int) Syscall { return Syscall{Name: name, Nr: nr, AF: af} }

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
