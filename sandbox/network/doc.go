// Package network joins a pod's network namespace to the pod's VM, as Kata does by default:
// a tap device is made in the namespace beside the pod's interface (the veth CNI put there,
// holding the pod's IP), and two tc filters connect them — every frame arriving on the
// interface is redirected to the tap's egress, so it reaches the guest, and every frame the
// guest sends, arriving on the tap, is redirected to the interface's egress if the guard
// (filter.go) finds it comes from the NIC's MAC and the pod's addresses, and dropped if not.
// The namespace's own stack never sees the pod's traffic. QEMU gets the tap's queue
// descriptor as a virtio-net NIC with the interface's MAC; the guest agent gives the guest's
// NIC the interface's name, MTU, addresses and routes, which Attach reads and returns.
//
// # Attach and Detach
//
// Attach works through netlink sockets bound to the namespace (vishvananda/netlink handles),
// with no thread switching, except for one step: a tap is created in the network namespace
// of the process that opened /dev/net/tun, so /dev/net/tun is opened on a locked OS thread
// that joins the namespace and goes back to its own (a thread that cannot go back stays
// locked and the runtime ends it). TUNSETIFF on that descriptor, from any thread, then makes
// the tap in the pod's namespace. Do runs any code that way: package sandbox starts the pod's
// QEMU with it, so that QEMU is born in the pod's namespace. The other way round does not work: a descriptor opened in
// another namespace (the host's) cannot attach to a tap in the pod's by name: TUNSETIFF looks
// the name up in the descriptor's own namespace and makes a new tap there
// (TestTapNameIsPerNamespace shows it, a second test namespace standing for the host's).
//
// The pod's interface is chosen among the namespace's Ethernet interfaces other than
// loopback and tun/tap devices (tunnel devices such as sit0, which a new namespace may hold,
// are not Ethernet): the only one, or, among several, the one named eth0 (the name CNI is
// given by containerd's CRI). Anything else is an error that lists them.
//
// The tap is not persistent: it lives while a descriptor of it is open (the Endpoint's, and
// QEMU's copy), so a VM that dies takes it along. Detach removes it anyway, and the ingress
// qdisc of the pod's interface with the filter on it. Detach is idempotent: a tap, a qdisc or
// a whole namespace already gone is not an error.
//
// # Port-forward
//
// containerd's CRI serves port-forward itself, dialling localhost in the pod's namespace,
// where the guest's servers are not. RedirectLoopback (loopback.go) has every TCP connection
// the namespace makes to 127.0.0.1 or ::1 redirected (nftables, table ip and table ip6
// kvfs-portforward, nat on the output hook) to a listener bound there for the caller, the
// shim's relay, which reads the port dialled off each connection (OriginalPort) and carries
// it to the guest. Close deletes the tables and closes the listeners; a namespace already gone
// is not an error.
//
// # Host networking
//
// A VM cannot share the host's network namespace: its NIC would have to take over a host
// interface. CheckPodNetNS refuses a pod without a namespace of its own (Kubernetes'
// hostNetwork: no namespace path in the spec) and a path that is the host's namespace, with
// an error saying so, as Kata refuses them.
//
// # Threat model
//
// The namespace path comes from containerd (the sandbox container's spec) and is trusted to
// name the pod's namespace; it is still checked to be a network namespace and not the host's.
// The guest is hostile: root in it can write any frame to the tap, at any rate, whatever
// capabilities the pod's spec leaves its containers (a pod without NET_RAW, as Pod Security's
// "restricted" profile asks, has its containers confined in the guest, but the guest kernel is
// the hostile party). The guard lets through only what a pod on a runc veth could send without
// NET_RAW's forging: frames from the NIC's MAC, untagged, that are IPv4 from the pod's IPv4
// addresses, ARP with the MAC and one of those as sender, or IPv6 from the pod's IPv6
// addresses or the MAC's link-local address (and from :: only duplicate address detection of
// those and MLD); it drops ICMPv6 router advertisements and redirects and neighbour
// advertisements for other addresses, which would take over a neighbour's traffic with a
// genuine source. What passes is redirected to the pod's interface and so only ever reaches
// what the pod's veth reaches (its peer, and from there whatever the CNI configuration lets
// the pod reach); what is dropped, and the namespace's own stack, the tap's other processes
// and the host's interfaces never see any of it. Within those rules the guest can still send
// anything from its own addresses — any protocol, port, destination or rate — and IPv6 from
// its link-local address, as root in a runc pod with NET_RAW on the same veth could:
// filtering that (network policy) stays the CNI configuration's job, as for any pod. Not
// checked: the link-layer address options inside neighbour solicitations and advertisements
// (a guest can name another MAC there, which at worst sends its own pod's traffic astray), and
// fragmented ICMPv6 from the pod's addresses (Linux ignores fragmented neighbour discovery;
// other systems on the pod network may not).
// TestTapGuard sends forged frames into a tap; TestNetworkInGuest forges from a real guest.
// Nothing the guest sends reaches this package: Attach reads the namespace before the VM
// starts, and Detach only deletes by name what Attach made.
package network
