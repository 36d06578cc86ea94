// Package virtq implements virtio 1.x split virtqueues: the device side ([Queue]), which the
// vhost-user back-end runs on each queue's goroutine, and a driver side ([Driver]), which plays
// the guest in tests and in the in-repo front-end.
//
// # Threat model
//
// The rings and everything they point to live in guest memory. The guest controls every byte of
// them and may rewrite any of it at any moment, including while the device is reading it. The
// device side therefore:
//
//   - copies every value it reads from the rings (avail idx, ring entries, descriptors) into a
//     local once, then validates and uses only the copy, so a concurrent rewrite cannot change a
//     value between its check and its use;
//   - checks every index against the table it indexes (head and next < queue size, next < table
//     length inside an indirect table) and refuses an avail idx more than Size ahead of the last
//     one seen;
//   - bounds every loop the guest drives: a chain visits at most Size descriptors of the queue's
//     table and at most the table length of an indirect table (itself at most
//     max(Size, [MaxIndirectDescs]) descriptors); indirect tables may not nest, so a chain is
//     walked in at most Size + max(Size, MaxIndirectDescs) steps;
//   - translates every descriptor through guestmem with overflow-safe range checks, so no buffer
//     handed out reaches outside guest memory (a buffer spanning two adjacent regions becomes two
//     slices), and adds lengths with overflow checks;
//   - enforces the spec's structural rules: readable descriptors before writable ones, INDIRECT
//     only if negotiated, never together with NEXT, never inside an indirect table, an indirect
//     table length that is a non-zero multiple of 16 lying in one memory region.
//
// Any violation is an error wrapping [ErrInvalidRing]; the queue is then broken for good (see
// [Queue.Next]), as virtio's "device needs reset" prescribes. Nothing here panics on anything the
// guest writes.
//
// The buffers of a [Chain] are slices of guest memory, still shared with the guest: whoever parses
// them must copy a field before checking it, exactly as this package does for descriptors.
//
// The ring addresses ([Config]) and the memory table come from the front-end, which is trusted to
// give addresses of the rings the guest configured; they are still checked to lie in guest memory
// and to be aligned.
//
// # Memory ordering
//
// Device and driver share the rings without locks. The virtio protocol needs four orderings,
// which this package gets from Go atomics (the only ordering tools Go offers) as follows:
//
//  1. Driver publishes: descriptors and avail ring entry, then avail idx (release). The driver
//     stores the 4-byte {flags, idx} word of the avail ring atomically (the driver owns both).
//     The device loads avail idx with atomic.LoadUint32 (acquire) on the naturally aligned
//     4-byte word containing it that lies inside the avail ring: {flags, idx} if the ring is
//     4-aligned, {idx, ring[0]} if it is only 2-aligned. Entries are read only after that load,
//     and only those below the idx it returned.
//  2. Device completes: used element, then used idx (release). The used ring is 4-aligned and
//     the device owns both of its first fields, so the device stores {flags, idx} with one
//     atomic.StoreUint32; the driver loads it atomically (acquire) before reading elements.
//  3. Device decides whether to interrupt: used idx store, then (full barrier) read used_event or
//     avail.flags. Store-to-load ordering needs a full barrier; see fence in access.go.
//  4. Device re-enables kicks: write avail_event or clear NO_NOTIFY, full barrier, re-read avail
//     idx, so a chain published while kicks were off is never missed. A device that polls the
//     avail ring with kicks suppressed ([Queue.SuppressNotify], [Queue.Available]) ends every
//     poll with EnableNotify for the same reason.
//
// used_event and avail_event are 16-bit fields at the end of the rings; the naturally aligned
// 4-byte word around them may extend past the ring, so they are accessed with single 16-bit
// loads and stores (which cannot tear on aligned addresses) ordered by explicit fences, and are
// hidden from the race detector because their races are intended (they are hints, and the
// protocol tolerates stale values as long as the fences are there).
//
// The driver side mirrors this: publish with a release store, fence before deciding to kick,
// fence after re-enabling interrupts before re-checking the used ring.
//
// # Concurrency
//
// A Queue and a Driver are each used by one goroutine at a time. [Queue.Remap] must not run
// concurrently with the queue's other methods (the vhost-user layer excludes queue processing
// while it changes the memory table).
package virtq
