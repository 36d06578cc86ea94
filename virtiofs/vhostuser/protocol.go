package vhostuser

import "fmt"

// Request is a front-end → back-end request id (the header's request field).
type Request uint32

// Front-end → back-end request ids (vhost-user spec; QEMU 7.2 VhostUserRequest).
const (
	GetFeatures         Request = 1
	SetFeatures         Request = 2
	SetOwner            Request = 3
	ResetOwner          Request = 4
	SetMemTable         Request = 5
	SetLogBase          Request = 6
	SetLogFD            Request = 7
	SetVringNum         Request = 8
	SetVringAddr        Request = 9
	SetVringBase        Request = 10
	GetVringBase        Request = 11
	SetVringKick        Request = 12
	SetVringCall        Request = 13
	SetVringErr         Request = 14
	GetProtocolFeatures Request = 15
	SetProtocolFeatures Request = 16
	GetQueueNum         Request = 17
	SetVringEnable      Request = 18
	SendRARP            Request = 19
	NetSetMTU           Request = 20
	SetBackendReqFD     Request = 21
	IOTLBMsg            Request = 22
	SetVringEndian      Request = 23
	GetConfig           Request = 24
	SetConfig           Request = 25
	CreateCryptoSession Request = 26
	CloseCryptoSession  Request = 27
	PostcopyAdvise      Request = 28
	PostcopyListen      Request = 29
	PostcopyEnd         Request = 30
	GetInflightFD       Request = 31
	SetInflightFD       Request = 32
	GPUSetSocket        Request = 33
	ResetDevice         Request = 34
	VringKick           Request = 35
	GetMaxMemSlots      Request = 36
	AddMemReg           Request = 37
	RemMemReg           Request = 38
	SetStatus           Request = 39
	GetStatus           Request = 40
)

// payloadKind is the wire layout of a request's payload.
type payloadKind uint8

const (
	payloadNone         payloadKind = iota // size 0
	payloadU64                             // 8
	payloadVringState                      // 8
	payloadVringAddr                       // 40
	payloadVringFile                       // 8 (u64: index bits 0-7, NOFD bit 8)
	payloadMemTable                        // 8 + 32*n, n <= MaxFDs
	payloadSingleRegion                    // 40
	payloadLog                             // 16
	payloadOpaque                          // layout we do not decode; any size <= MaxPayload
)

// fdRule says how many file descriptors a request may carry.
type fdRule uint8

const (
	fdsNone      fdRule = iota // 0
	fdsOne                     // exactly 1
	fdsOptional                // 0 or 1 (the receiver closes it)
	fdsPerRegion               // one per memory-table region
	fdsVringFile               // 1 unless the NOFD bit is set, then 0
	fdsAny                     // up to MaxFDs (opaque requests the back-end rejects anyway)
)

// requestInfo describes one request id. The table below is the single source of truth for names
// (logs), payload layout and size checks (Decode), fd counts (Decode) and whether the request has a
// reply body of its own (REPLY_ACK handling in the Backend, reply reading in the Client).
type requestInfo struct {
	name    string
	payload payloadKind
	fds     fdRule
	// reply: the back-end always answers with a body of its own (so REPLY_ACK does not add one).
	reply bool
}

var requests = [...]requestInfo{
	GetFeatures:         {"GET_FEATURES", payloadNone, fdsNone, true},
	SetFeatures:         {"SET_FEATURES", payloadU64, fdsNone, false},
	SetOwner:            {"SET_OWNER", payloadNone, fdsNone, false},
	ResetOwner:          {"RESET_OWNER", payloadNone, fdsNone, false},
	SetMemTable:         {"SET_MEM_TABLE", payloadMemTable, fdsPerRegion, false},
	SetLogBase:          {"SET_LOG_BASE", payloadLog, fdsOne, false},
	SetLogFD:            {"SET_LOG_FD", payloadNone, fdsOne, false},
	SetVringNum:         {"SET_VRING_NUM", payloadVringState, fdsNone, false},
	SetVringAddr:        {"SET_VRING_ADDR", payloadVringAddr, fdsNone, false},
	SetVringBase:        {"SET_VRING_BASE", payloadVringState, fdsNone, false},
	GetVringBase:        {"GET_VRING_BASE", payloadVringState, fdsNone, true},
	SetVringKick:        {"SET_VRING_KICK", payloadVringFile, fdsVringFile, false},
	SetVringCall:        {"SET_VRING_CALL", payloadVringFile, fdsVringFile, false},
	SetVringErr:         {"SET_VRING_ERR", payloadVringFile, fdsVringFile, false},
	GetProtocolFeatures: {"GET_PROTOCOL_FEATURES", payloadNone, fdsNone, true},
	SetProtocolFeatures: {"SET_PROTOCOL_FEATURES", payloadU64, fdsNone, false},
	GetQueueNum:         {"GET_QUEUE_NUM", payloadNone, fdsNone, true},
	SetVringEnable:      {"SET_VRING_ENABLE", payloadVringState, fdsNone, false},
	SendRARP:            {"SEND_RARP", payloadOpaque, fdsAny, false},
	NetSetMTU:           {"NET_SET_MTU", payloadOpaque, fdsAny, false},
	SetBackendReqFD:     {"SET_BACKEND_REQ_FD", payloadNone, fdsOne, false},
	IOTLBMsg:            {"IOTLB_MSG", payloadOpaque, fdsAny, false},
	SetVringEndian:      {"SET_VRING_ENDIAN", payloadOpaque, fdsAny, false},
	GetConfig:           {"GET_CONFIG", payloadOpaque, fdsAny, false},
	SetConfig:           {"SET_CONFIG", payloadOpaque, fdsAny, false},
	CreateCryptoSession: {"CREATE_CRYPTO_SESSION", payloadOpaque, fdsAny, false},
	CloseCryptoSession:  {"CLOSE_CRYPTO_SESSION", payloadOpaque, fdsAny, false},
	PostcopyAdvise:      {"POSTCOPY_ADVISE", payloadOpaque, fdsAny, false},
	PostcopyListen:      {"POSTCOPY_LISTEN", payloadOpaque, fdsAny, false},
	PostcopyEnd:         {"POSTCOPY_END", payloadOpaque, fdsAny, false},
	GetInflightFD:       {"GET_INFLIGHT_FD", payloadOpaque, fdsAny, false},
	SetInflightFD:       {"SET_INFLIGHT_FD", payloadOpaque, fdsAny, false},
	GPUSetSocket:        {"GPU_SET_SOCKET", payloadOpaque, fdsAny, false},
	ResetDevice:         {"RESET_DEVICE", payloadNone, fdsNone, false},
	VringKick:           {"VRING_KICK", payloadOpaque, fdsAny, false},
	GetMaxMemSlots:      {"GET_MAX_MEM_SLOTS", payloadNone, fdsNone, true},
	AddMemReg:           {"ADD_MEM_REG", payloadSingleRegion, fdsOne, false},
	RemMemReg:           {"REM_MEM_REG", payloadSingleRegion, fdsOptional, false},
	SetStatus:           {"SET_STATUS", payloadOpaque, fdsAny, false},
	GetStatus:           {"GET_STATUS", payloadOpaque, fdsAny, false},
}

// info returns the table entry of r, or ok == false for an id the table does not know.
func (r Request) info() (requestInfo, bool) {
	if int(r) >= len(requests) || requests[r].name == "" {
		return requestInfo{}, false
	}
	return requests[r], true
}

// Known reports whether r is in the request table.
func (r Request) Known() bool {
	_, ok := r.info()
	return ok
}

// HasReply reports whether the back-end answers r with a reply body of its own (GET_* requests).
// For the other requests a reply is sent only as a REPLY_ACK acknowledgement.
func (r Request) HasReply() bool {
	i, _ := r.info()
	return i.reply
}

func (r Request) String() string {
	if i, ok := r.info(); ok {
		return i.name
	}
	return fmt.Sprintf("REQUEST_%d", uint32(r))
}

// BackendRequest is a back-end → front-end request id, sent on the channel set up with
// SET_BACKEND_REQ_FD.
type BackendRequest uint32

// Back-end → front-end request ids. Upstream QEMU 7.2's slave_read handles 1–3 only; 6 and 7
// are the virtio-fs DAX messages of the out-of-tree series Kata's experimental QEMU carries
// (VHOST_USER_SLAVE_FS_MAP/UNMAP), which upstream QEMU answers with failure.
const (
	BackendIOTLBMsg          BackendRequest = 1
	BackendConfigChangeMsg   BackendRequest = 2
	BackendVringHostNotifier BackendRequest = 3
	BackendFSMap             BackendRequest = 6
	BackendFSUnmap           BackendRequest = 7
)

var backendRequestNames = map[BackendRequest]string{
	BackendIOTLBMsg:          "BACKEND_IOTLB_MSG",
	BackendConfigChangeMsg:   "BACKEND_CONFIG_CHANGE_MSG",
	BackendVringHostNotifier: "BACKEND_VRING_HOST_NOTIFIER_MSG",
	BackendFSMap:             "BACKEND_FS_MAP",
	BackendFSUnmap:           "BACKEND_FS_UNMAP",
}

func (r BackendRequest) String() string {
	if s, ok := backendRequestNames[r]; ok {
		return s
	}
	return fmt.Sprintf("BACKEND_REQUEST_%d", uint32(r))
}

// Header flag bits.
const (
	FlagVersionMask uint32 = 0x3
	Version         uint32 = 0x1
	FlagReply       uint32 = 0x4
	FlagNeedReply   uint32 = 0x8

	// ReplyFlags is the exact flags value of every reply; QEMU 7.2 rejects anything else.
	ReplyFlags = Version | FlagReply
)

// Virtio and vhost feature bits (GET/SET_FEATURES).
const (
	FeatureNotifyOnEmpty    uint64 = 1 << 24
	FeatureLogAll           uint64 = 1 << 26 // VHOST_F_LOG_ALL: dirty logging for migration
	FeatureAnyLayout        uint64 = 1 << 27
	FeatureIndirectDesc     uint64 = 1 << 28
	FeatureEventIdx         uint64 = 1 << 29
	FeatureProtocolFeatures uint64 = 1 << 30 // VHOST_USER_F_PROTOCOL_FEATURES
	FeatureVersion1         uint64 = 1 << 32
	FeatureAccessPlatform   uint64 = 1 << 33
	FeatureRingPacked       uint64 = 1 << 34
	FeatureInOrder          uint64 = 1 << 35
	FeatureRingReset        uint64 = 1 << 40
)

// Protocol feature bits (GET/SET_PROTOCOL_FEATURES).
const (
	ProtocolMQ                  uint64 = 1 << 0
	ProtocolLogSHMFD            uint64 = 1 << 1
	ProtocolRARP                uint64 = 1 << 2
	ProtocolReplyAck            uint64 = 1 << 3
	ProtocolNetMTU              uint64 = 1 << 4
	ProtocolBackendReq          uint64 = 1 << 5
	ProtocolCrossEndian         uint64 = 1 << 6
	ProtocolCryptoSession       uint64 = 1 << 7
	ProtocolPagefault           uint64 = 1 << 8
	ProtocolConfig              uint64 = 1 << 9 // never offered: advertising it crashes QEMU 7.1–7.2.2
	ProtocolBackendSendFD       uint64 = 1 << 10
	ProtocolHostNotifier        uint64 = 1 << 11
	ProtocolInflightSHMFD       uint64 = 1 << 12
	ProtocolResetDevice         uint64 = 1 << 13
	ProtocolInbandNotifications uint64 = 1 << 14
	ProtocolConfigureMemSlots   uint64 = 1 << 15
	ProtocolStatus              uint64 = 1 << 16

	// QEMU72ProtocolMask is what QEMU 7.2 keeps of a back-end's protocol feature offer
	// (bits >= 17 are dropped).
	QEMU72ProtocolMask uint64 = 1<<17 - 1
)

// Vring file (SET_VRING_KICK/CALL/ERR) payload bits.
const (
	VringIndexMask uint64 = 0xff
	VringNoFD      uint64 = 1 << 8
)

// VringFlagLog is the SET_VRING_ADDR flag asking for used-ring dirty logging.
const VringFlagLog uint32 = 1 << 0

// Limits.
const (
	// HeaderSize is the size of a message header.
	HeaderSize = 12
	// MaxFDs is the most file descriptors one message may carry (VHOST_MEMORY_BASELINE_NREGIONS).
	MaxFDs = 8
	// MaxMemTableRegions is the most regions in one SET_MEM_TABLE.
	MaxMemTableRegions = MaxFDs
	// MaxPayload bounds a message payload. The largest payload vhost-user-fs uses is 268 bytes
	// (VhostUserConfig); QEMU's largest member (the crypto session) is under 1 KiB.
	MaxPayload = 4096
	// MaxMemSlots is the answer to GET_MAX_MEM_SLOTS (libvhost-user's VHOST_USER_MAX_RAM_SLOTS).
	MaxMemSlots = 32
	// MaxQueueSize is the largest split-ring size.
	MaxQueueSize = 32768
)
