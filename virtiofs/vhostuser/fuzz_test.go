package vhostuser

import (
	"bytes"
	"reflect"
	"testing"
)

// FuzzDecode feeds arbitrary messages (header + payload) and fd counts to the request decoder.
// It must never panic, and whatever it accepts must encode back to exactly the payload it was
// given (so nothing the front-end sent is silently dropped, padding included) and decode again
// to the same value.
// Seeds live in testdata/fuzz/FuzzDecode and run with every go test.
func FuzzDecode(f *testing.F) {
	f.Add(Encode(GetFeatures, Version, Empty{}), uint8(0))
	f.Add(Encode(SetVringKick, Version, VringFile{Index: 1}), uint8(1))
	f.Fuzz(func(t *testing.T, data []byte, nfds uint8) {
		if len(data) < HeaderSize {
			if _, err := ParseHeader(data); err == nil {
				t.Fatal("short header accepted")
			}
			return
		}
		h, err := ParseHeader(data[:HeaderSize])
		if err != nil {
			t.Fatal(err)
		}
		payload := data[HeaderSize:]
		if h.CheckRequest() != nil || int(h.Size) != len(payload) {
			return
		}
		n := int(nfds % (MaxFDs + 2))
		p, err := Decode(h.Request, payload, n)
		if err != nil {
			return
		}
		again := p.Append(nil)
		if !bytes.Equal(again, payload) {
			t.Fatalf("%v: accepted payload %x re-encodes as %x", h.Request, payload, again)
		}
		p2, err := Decode(h.Request, again, n)
		if err != nil {
			t.Fatalf("%v: re-encoded payload rejected: %v", h.Request, err)
		}
		if !reflect.DeepEqual(p, p2) {
			t.Fatalf("%v: round trip %#v != %#v", h.Request, p2, p)
		}
	})
}
