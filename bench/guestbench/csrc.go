package guestbench

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// writeCSources writes the C program the guest builds with tcc into dir: n translation units of
// a few functions each over a shared header, and a main that calls them all and prints
// "cbuild ok" when their results add up. Plain C99 against stdio.h, stdlib.h and string.h.
func writeCSources(dir string, n int) error {
	if n < 1 {
		return fmt.Errorf("C build: %d source files", n)
	}
	if err := os.Mkdir(dir, 0o755); err != nil {
		return err
	}
	var h strings.Builder
	h.WriteString("#ifndef GB_COMMON_H\n#define GB_COMMON_H\n#include <stdio.h>\n#include <stdlib.h>\n#include <string.h>\n\n")
	h.WriteString("struct gb_acc { unsigned long sum; char tag[32]; };\n\n")
	for i := range n {
		fmt.Fprintf(&h, "unsigned long gb_unit%d(struct gb_acc *a, unsigned long seed);\n", i)
	}
	h.WriteString("#endif\n")
	if err := os.WriteFile(filepath.Join(dir, "common.h"), []byte(h.String()), 0o644); err != nil {
		return err
	}
	var want uint64
	for i := range n {
		var c strings.Builder
		fmt.Fprintf(&c, "#include \"common.h\"\n\n")
		for f := range 8 {
			fmt.Fprintf(&c, "static unsigned long f%d_%d(unsigned long x)\n{\n\tunsigned long r = x;\n\tint k;\n", i, f)
			fmt.Fprintf(&c, "\tfor (k = 0; k < %d; k++)\n\t\tr = r * 31 + %d + (r >> 7);\n\treturn r;\n}\n\n", 8+f, i*8+f)
		}
		fmt.Fprintf(&c, "unsigned long gb_unit%d(struct gb_acc *a, unsigned long seed)\n{\n\tunsigned long r = seed;\n", i)
		for f := range 8 {
			fmt.Fprintf(&c, "\tr ^= f%d_%d(r + %d);\n", i, f, f)
		}
		fmt.Fprintf(&c, "\ta->sum += r;\n\tsnprintf(a->tag, sizeof a->tag, \"unit%%d\", %d);\n\treturn r;\n}\n", i)
		if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("unit%03d.c", i)), []byte(c.String()), 0o644); err != nil {
			return err
		}
		want += cUnit(i, uint64(i))
	}
	var m strings.Builder
	m.WriteString("#include \"common.h\"\n\nint main(void)\n{\n\tstruct gb_acc a;\n\tmemset(&a, 0, sizeof a);\n")
	for i := range n {
		fmt.Fprintf(&m, "\tgb_unit%d(&a, %dUL);\n", i, i)
	}
	fmt.Fprintf(&m, "\tif (a.sum != %dUL) {\n\t\tprintf(\"cbuild bad sum %%lu\\n\", a.sum);\n\t\treturn 1;\n\t}\n", want)
	m.WriteString("\tprintf(\"cbuild ok\\n\");\n\treturn 0;\n}\n")
	return os.WriteFile(filepath.Join(dir, "main.c"), []byte(m.String()), 0o644)
}

// cUnit computes what gb_unitI returns for seed, as the generated C does (unsigned long is 64
// bits on x86-64 and wraps the same way).
func cUnit(i int, seed uint64) uint64 {
	r := seed
	for f := range 8 {
		x := r + uint64(f)
		for range 8 + f {
			x = x*31 + uint64(i*8+f) + (x >> 7)
		}
		r ^= x
	}
	return r
}
