package agent

import (
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
)

// DefaultDMITable is where the kernel shows the SMBIOS structure table the firmware left
// (CONFIG_DMI; readable by root only): it holds the host's secret (ReadSecret).
const DefaultDMITable = "/sys/firmware/dmi/tables/DMI"

// SMBIOS, as far as ReadSecret reads it (DMTF DSP0134): a structure is a header (type, length
// of its formatted part, handle), its formatted part, then its strings, each ending in a NUL,
// the set ending in one more (two NULs when there is none).
const (
	smbiosHeaderLen  = 4
	smbiosTypeOEM    = 11  // OEM strings: every string of the structure is one
	smbiosTypeEnd    = 127 // end of table
	maxSMBIOSTable   = 1 << 20
	smbiosStringsEnd = "\x00\x00"
)

// ReadSecret answers the host's secret for this boot: the SMBIOS OEM string
// apiv1.SecretOEMPrefix followed by apiv1.SecretLen bytes in hex, in the structure table at
// path (DefaultDMITable), where QEMU put it (-smbios type=11,path=: the host gives QEMU the
// string in a file, never on its command line). The agent serves no connection without it.
// One such string, and only one, must be there.
func ReadSecret(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("the host's secret: SMBIOS table: %w", err)
	}
	defer f.Close()
	table, err := io.ReadAll(io.LimitReader(f, maxSMBIOSTable+1))
	if err != nil {
		return nil, fmt.Errorf("the host's secret: SMBIOS table: %w", err)
	}
	if len(table) > maxSMBIOSTable {
		return nil, fmt.Errorf("the host's secret: SMBIOS table %s: more than %d bytes", path, maxSMBIOSTable)
	}
	secret, err := secretOfSMBIOS(table)
	if err != nil {
		return nil, fmt.Errorf("the host's secret: SMBIOS table %s: %w", path, err)
	}
	return secret, nil
}

// secretOfSMBIOS finds the secret's OEM string in an SMBIOS structure table.
func secretOfSMBIOS(table []byte) ([]byte, error) {
	var found []string
	for off := 0; off < len(table); {
		if len(table)-off < smbiosHeaderLen {
			return nil, fmt.Errorf("structure at %d: truncated header", off)
		}
		typ, n := table[off], int(table[off+1])
		if n < smbiosHeaderLen || len(table)-off < n {
			return nil, fmt.Errorf("structure at %d: formatted length %d", off, n)
		}
		strs := table[off+n:]
		end := bytes.Index(strs, []byte(smbiosStringsEnd))
		if end < 0 {
			return nil, fmt.Errorf("structure at %d: strings without their end", off)
		}
		if typ == smbiosTypeOEM && end > 0 {
			for _, s := range strings.Split(string(strs[:end]), "\x00") {
				if strings.HasPrefix(s, apiv1.SecretOEMPrefix) {
					found = append(found, strings.TrimPrefix(s, apiv1.SecretOEMPrefix))
				}
			}
		}
		if typ == smbiosTypeEnd {
			break
		}
		off += n + end + len(smbiosStringsEnd)
	}
	switch {
	case len(found) == 0:
		return nil, fmt.Errorf("no OEM string %s (the host passes it to QEMU with -smbios type=11,path=)", apiv1.SecretOEMPrefix)
	case len(found) > 1:
		return nil, fmt.Errorf("%d OEM strings %s, want one", len(found), apiv1.SecretOEMPrefix)
	}
	secret, err := hex.DecodeString(found[0])
	if err != nil || len(secret) != apiv1.SecretLen {
		return nil, errors.New("the OEM string " + apiv1.SecretOEMPrefix + " is not " + fmt.Sprint(apiv1.SecretLen) + " bytes in hex")
	}
	return secret, nil
}
