//go:build race

package sandbox

// raceEnabled says whether this test binary (and so the confined servers it starts) runs under
// the race detector, whose own memory grows with what the program has done.
const raceEnabled = true
