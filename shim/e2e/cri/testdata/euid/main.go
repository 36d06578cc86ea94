// Command euid prints its real and effective user ids. TestCRIPod installs it set-user-ID
// root.
package main

import (
	"fmt"
	"os"
)

func main() { fmt.Printf("uid %d euid %d\n", os.Getuid(), os.Geteuid()) }
