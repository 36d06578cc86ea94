// Package vhostuser implements the vhost-user protocol for a virtio device back-end (the role
// virtiofsd plays for QEMU's vhost-user-fs-pci): the message codec, a Conn that moves messages and
// their SCM_RIGHTS file descriptors over a unix stream socket, a Backend that serves one front-end
// connection for a Device, and a Client that plays the front-end (QEMU 7.2) for tests and for the
// in-repo front-end.
//
// # Layout
//
//   - protocol.go: the request table (names, payload layout, fd rules, whether a request has a
//     reply of its own) and the feature, protocol-feature and flag constants. Every request id is
//     declared once; decoding, logging and reply handling are driven by that table.
//   - message.go: header and payload types, Encode and Decode with strict size and fd-count checks.
//   - conn.go: reading one message with its fds, writing messages and replies.
//   - backend.go, vring.go: the back-end state machine and the per-ring goroutines.
//   - client.go: the front-end side.
//
// # Threat model
//
// The front-end (QEMU, and through its vhost-user messages whoever controls it) is not trusted to
// be well-formed. It controls every byte of every message: request ids, flags, sizes, payload
// fields, how many fds are attached and what they are; the memory table (addresses, sizes,
// offsets, the fds behind them); ring sizes, addresses and bases; the kick, call and error fds;
// and the order of messages. The guest driver controls the contents of guest memory, including
// the rings, which the virtq package treats as hostile.
//
// The back-end therefore:
//   - bounds every payload (MaxPayload) before allocating, checks every payload size exactly
//     against the request table, and rejects reserved bits, unknown flags, more than 8 regions in
//     SET_MEM_TABLE, region ranges that wrap around 2^64, out-of-range vring indexes, ring sizes
//     that are not a power of two up to 32768, bases wider than 16 bits and misaligned rings;
//   - never leaks a received fd: a Conn closes everything on a read error, more than MaxFDs fds
//     or a truncated control message; fds a request does not use are closed after it is handled
//     (Message.Close); a request with the wrong number of fds is refused;
//   - refuses feature and protocol-feature bits it did not offer, and never offers CONFIG (bit 9:
//     it crashes QEMU 7.1–7.2.2) nor dirty logging (it is not migratable);
//   - makes notifier fds non-blocking, so a front-end passing something other than an eventfd
//     cannot make a ring goroutine block; a kick fd that reports an error, a hang-up or end of
//     file breaks its ring instead of spinning;
//   - with adaptive polling (WithAdaptivePolling, off by default), lets the guest decide how
//     much of the poll limit a ring spends after each batch, never more: a poll follows only a
//     batch the ring served and lasts at most the limit from its end, whatever the guest
//     writes into the rings (Vring.run); a guest that goes quiet costs one window at most;
//   - treats a panic or error in Device.HandleQueue as a broken ring (logged, error eventfd
//     signalled, ring no longer served), not as a process failure;
//   - checks every reply on the back-end channel (FS_MAP, FS_UNMAP: flags exactly 0x5, the
//     request's id, an 8-byte payload, no fds) and waits for it at most the back-end timeout; a
//     bad, late or missing reply closes the channel, so DAX requests fail instead of hanging and
//     a stale reply is never taken for a later request's.
//
// What it does not defend against: a front-end that shrinks a memory file after handing it over
// (touching the lost pages raises SIGBUS; guestmem documents this), and a front-end starving its
// own device (never kicking, sending huge numbers of messages). Both only hurt the front-end's own
// guest.
//
// Errors: a failed request that the front-end asked to have acknowledged (NEED_REPLY with
// REPLY_ACK negotiated) is answered with a non-zero ack and the connection continues. Any other
// failure, including any malformed header, closes the connection: the front-end would otherwise
// believe the request succeeded.
//
// # Concurrency and lock order
//
// Serve runs the message loop on the caller's goroutine; all connection and ring configuration
// is owned by it and needs no lock. Each started ring has one goroutine that waits with
// epoll_wait(2), on an epoll instance of its own, for the ring's kick eventfd and a private wake
// eventfd (used to stop it, to re-check after SET_VRING_ENABLE(1), and to let it notice it is
// broken), both edge-triggered so that a wake-up is one system call (Vring.run). The goroutine
// closes its epoll instance before it exits, and the message loop closes the kick fd only after
// that, so an fd number is never closed while being waited on. A ring that polls after a batch
// (WithAdaptivePolling) takes the memory read lock for each look at the avail ring only, and
// checks for a stop, a disabled or broken ring and a Wake between looks, so neither the
// message loop nor a Wake waits for its window to run out.
//
// Locks, in the order they are taken:
//
//  1. session.memMu (sync.RWMutex) guards the guest memory table and each ring's *virtq.Queue.
//     Ring goroutines hold it for reading while Device.HandleQueue runs. The message loop holds
//     it for writing to replace memory (SET_MEM_TABLE, ADD_MEM_REG, REM_MEM_REG: the new table is
//     mapped before and the old regions unmapped after the lock is held, running rings are
//     remapped under it) and to install or remove a ring's queue. The message loop never waits
//     for a ring goroutine while holding it.
//  2. Vring.fdMu guards the call and error fds: Notify (under memMu read) signals the call fd
//     while SET_VRING_CALL swaps it; the old fd is closed after the swap, outside the lock. It
//     also covers setting and clearing the ring's wake fd, which Vring.Wake signals from any
//     goroutine.
//  3. Backend.reqMu serialises back-end requests (FSMap, FSUnmap: a request and its reply). Ring
//     goroutines take it, under memMu read, from Device.HandleQueue; the message loop never
//     does, so it never waits for the front-end's answer on the back-end channel.
//  4. Backend.chMu guards which back-end channel is current; it is a leaf. The message loop
//     replaces or closes the channel under it (SET_BACKEND_REQ_FD, end of Serve) without
//     waiting for reqMu: closing the socket fails a request waiting on it.
//
// A back-end request waits for its reply at most the back-end timeout (WithBackendTimeout). A
// front-end that stops serving the back-end channel while it waits for the back-end on the main
// connection (QEMU 7.2.3+ does not nest its event loop) and a queue goroutine waiting for a DAX
// reply under memMu would otherwise deadlock with a SET_MEM_TABLE or GET_VRING_BASE; the timeout
// breaks that: the request fails (the guest sees an error for that mapping), the channel is
// closed, and later DAX requests fail at once.
//
// Device.HandleQueue must not block indefinitely, since memory updates and GET_VRING_BASE wait
// for it. Slices obtained from guest memory must not be used after HandleQueue returns: a memory
// update may unmap them. A device that spreads a batch over worker goroutines must wait for them
// before returning (the read lock covers them), and serialise its own use of the Queue. A device
// that finishes a request later, on a goroutine of its own, keeps no guest memory: it asks for
// another HandleQueue call with Vring.Wake and completes the chain from there, re-reading its
// buffers (virtq.Queue.Rewalk) under the memory table of that call.
//
// # Ring lifecycle
//
// A ring starts on SET_VRING_KICK (it needs SET_VRING_NUM and SET_VRING_ADDR first and the ring
// addresses must be mapped) and stops on GET_VRING_BASE, which also closes its kick and call fds
// and replies with the next available index; a later SET_VRING_KICK starts it again (a guest
// reboot). A SET_VRING_KICK for a running ring replaces its kick fd. If PROTOCOL_FEATURES was
// negotiated, a ring starts disabled and is processed only after SET_VRING_ENABLE(1); otherwise
// it is enabled. A kick with NOFD makes the ring polled (WithPollInterval).
//
// Device.Reset is called on RESET_OWNER, RESET_DEVICE and when Serve returns, not when all rings
// are stopped: QEMU 7.2 sends the same GET_VRING_BASE sequence for a guest reset and for a VM
// pause that must resume with the device state intact, so at this layer the two cannot be told
// apart. A virtio-fs device should treat a new FUSE_INIT as the sign of a reset guest driver.
package vhostuser
