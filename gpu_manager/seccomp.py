"""The seccomp filter of a function's worker: the system calls a handler never needs, refused.

The policy is data (`RULES`, a deny list); `program` turns it into a classic-BPF program for one
architecture (pure); `unavailable_reason` and `install` are the only calls that touch the process.

What is refused follows the intent of Docker's default profile (moby `profiles/seccomp/default.json`:
what it grants only to a container holding CAP_SYS_ADMIN, CAP_SYS_PTRACE, CAP_SYS_MODULE, ...,
none of which a worker needs) expressed, as systemd's `SystemCallFilter=~...` is, as a list of
refusals over an allow-by-default filter: a handler may import any library and start threads and
processes, so an allow-list would have to foresee every runtime's calls. Each refused call returns
EPERM (Docker's answer), but for clone3, which returns ENOSYS: its flags sit behind a pointer that
a filter cannot read, and on ENOSYS glibc falls back to clone, whose flags it can (Docker and
Chromium do the same).

The program checks the architecture first (a foreign one, such as i386 calls made with `int 0x80`
on x86_64, numbers its calls differently, so it is killed: libseccomp's default for an
architecture not in the filter, and systemd's `SystemCallArchitectures=native`), then refuses x32
calls on x86_64 (ENOSYS: they share the architecture value and carry bit 30 in their number), then
matches the number. A verdict that depends on the number alone (all but clone's, personality's and
socket's) is cached by the kernel (5.11 and later): an allowed call does not run the filter again.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_AARCH64 = 0xC00000B7
X32_SYSCALL_BIT = 0x40000000  # x32 calls: x86_64's architecture value, this bit in the number

RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000  # | errno
RET_ALLOW = 0x7FFF0000

# Classic BPF (linux/filter.h), the forms a seccomp program uses here.
LD_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS: A = 32 bits of seccomp_data at k
JEQ = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
JGE = 0x35  # BPF_JMP | BPF_JGE | BPF_K
JSET = 0x45  # BPF_JMP | BPF_JSET | BPF_K: A & k != 0
RET = 0x06  # BPF_RET | BPF_K
MAX_INSTRUCTIONS = 4096  # BPF_MAXINSNS
MAX_JUMP = 255  # jt and jf are one byte

# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6].
NR_OFFSET = 0
ARCH_OFFSET = 4
ARGS_OFFSET = 16

# Namespace flags of clone(2) (linux/sched.h): Docker's mask 0x7E020000 (CLONE_NEWTIME is clone3's
# and unshare's only: in clone's flags that bit is part of the exit signal).
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
NAMESPACE_FLAGS = (
    CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
)
# personality(2) values Docker allows: PER_LINUX, PER_LINUX32, UNAME26, both, and the query.
PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)
AF_VSOCK = 40


class Instruction(NamedTuple):
    """One classic-BPF instruction (struct sock_filter)."""

    code: int
    jt: int
    jf: int
    k: int


@dataclass(frozen=True, slots=True)
class AnyFlag:
    """Refused when any bit of `mask` is set in argument `index`."""

    index: int
    mask: int


@dataclass(frozen=True, slots=True)
class OneOf:
    """Refused when argument `index` is one of `values`."""

    index: int
    values: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class NoneOf:
    """Refused unless argument `index` is one of `values`."""

    index: int
    values: tuple[int, ...]


Condition = AnyFlag | OneOf | NoneOf


@dataclass(frozen=True, slots=True)
class Rule:
    """System call `name` is refused with `errno`: always, or when `when` holds. A condition reads
    the low 32 bits of its argument: the kernel reads no more of those refused here (clone's
    flags, personality's and socket's first argument)."""

    name: str
    errno: int = errno.EPERM
    when: Condition | None = None


def _refuse(*names: str) -> tuple[Rule, ...]:
    return tuple(Rule(name) for name in names)


RULES: tuple[Rule, ...] = (
    # Another process's memory and state (the node's too, where it runs as the same user).
    *_refuse("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd", "process_madvise"),
    # Namespaces, mounts and the root: a user namespace makes its creator root inside it, the
    # way into most kernel escalations; a worker's are set up before this filter.
    *_refuse("unshare", "setns", "mount", "umount2", "pivot_root", "chroot"),
    *_refuse("open_tree", "open_tree_attr", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr"),
    Rule("clone", when=AnyFlag(0, NAMESPACE_FLAGS)),  # threads and processes, not namespaces
    Rule("clone3", errno=errno.ENOSYS),  # glibc then uses clone (see the module's docstring)
    # The kernel itself: modules, another kernel, BPF programs, performance counters, page-fault
    # handling in user space (a classic way to win a kernel race), the I/O ports.
    *_refuse("init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load"),
    *_refuse("bpf", "perf_event_open", "userfaultfd", "iopl", "ioperm", "lookup_dcookie", "uselib"),
    *_refuse("io_uring_setup", "io_uring_enter", "io_uring_register"),  # outside seccomp's view once set up
    *_refuse("keyctl", "add_key", "request_key"),  # the kernel's keyrings (not namespaced)
    # The host's state: accounting, swap, power, the kernel's log, clocks, quotas, names.
    *_refuse("acct", "swapon", "swapoff", "reboot", "syslog", "quotactl", "quotactl_fd"),
    *_refuse("settimeofday", "clock_settime", "adjtimex", "clock_adjtime", "sethostname", "setdomainname"),
    *_refuse("open_by_handle_at", "name_to_handle_at", "fanotify_init"),  # files by handle, bypassing paths
    Rule("personality", when=NoneOf(0, PERSONALITIES)),  # e.g. no ADDR_NO_RANDOMIZE for what it runs
    Rule("socket", when=OneOf(0, (AF_VSOCK,))),  # the hypervisor's sockets: outside any network namespace
)

# Numbers on x86_64 (arch/x86/entry/syscalls/syscall_64.tbl) and aarch64 (the generic table,
# asm-generic/unistd.h); None where the architecture has no such call.
_NUMBERS: dict[str, tuple[int | None, int | None]] = {
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "kcmp": (312, 272),
    "pidfd_getfd": (438, 438),
    "process_madvise": (440, 440),
    "unshare": (272, 97),
    "setns": (308, 268),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "chroot": (161, 51),
    "open_tree": (428, 428),
    "open_tree_attr": (467, 467),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
    "clone": (56, 220),
    "clone3": (435, 435),
    "init_module": (175, 105),
    "finit_module": (313, 273),
    "delete_module": (176, 106),
    "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "iopl": (172, None),
    "ioperm": (173, None),
    "lookup_dcookie": (212, 18),
    "uselib": (134, None),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "acct": (163, 89),
    "swapon": (167, 224),
    "swapoff": (168, 225),
    "reboot": (169, 142),
    "syslog": (103, 116),
    "quotactl": (179, 60),
    "quotactl_fd": (443, 443),
    "settimeofday": (164, 170),
    "clock_settime": (227, 112),
    "adjtimex": (159, 171),
    "clock_adjtime": (305, 266),
    "sethostname": (170, 161),
    "setdomainname": (171, 162),
    "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264),
    "fanotify_init": (300, 262),
    "personality": (135, 92),
    "socket": (41, 198),
    "seccomp": (317, 277),  # to install the filter (not refused)
}


@dataclass(frozen=True, slots=True)
class Arch:
    """An architecture the filter knows: its AUDIT_ARCH value, its system call numbers, and
    whether x32 calls arrive under the same value (x86_64)."""

    name: str
    audit_arch: int
    numbers: Mapping[str, int]
    x32: bool = False


def _table(column: int) -> dict[str, int]:
    return {name: number for name, pair in _NUMBERS.items() if (number := pair[column]) is not None}


ARCHES: dict[str, Arch] = {
    "x86_64": Arch("x86_64", AUDIT_ARCH_X86_64, _table(0), x32=True),
    "aarch64": Arch("aarch64", AUDIT_ARCH_AARCH64, _table(1)),
}
_MACHINES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}


def program(arch: Arch, rules: Iterable[Rule] = RULES) -> list[Instruction]:
    """The filter for `arch`: kill a call of another architecture, refuse x32 calls (ENOSYS),
    refuse each of `rules` the architecture has (by number, then by argument), allow the rest.
    A rule naming a call `arch` does not have is left out (there is nothing to refuse)."""
    code = [
        Instruction(LD_ABS, 0, 0, ARCH_OFFSET),
        Instruction(JEQ, 1, 0, arch.audit_arch),
        Instruction(RET, 0, 0, RET_KILL_PROCESS),
        Instruction(LD_ABS, 0, 0, NR_OFFSET),
    ]
    if arch.x32:
        code += [Instruction(JGE, 0, 1, X32_SYSCALL_BIT), _return(RET_ERRNO | errno.ENOSYS)]
    present = sorted(
        ((arch.numbers[rule.name], rule) for rule in rules if rule.name in arch.numbers), key=lambda pair: pair[0]
    )
    for number, rule in present:
        refused = _return(RET_ERRNO | rule.errno)
        if rule.when is None:
            code += [Instruction(JEQ, 0, 1, number), refused]
        else:
            block = _argument_block(rule.when, refused)
            code += [Instruction(JEQ, 0, len(block), number), *block]
    code.append(_return(RET_ALLOW))
    if len(code) > MAX_INSTRUCTIONS:
        raise ValueError(f"a seccomp program holds at most {MAX_INSTRUCTIONS} instructions, not {len(code)}")
    return code


def _return(verdict: int) -> Instruction:
    return Instruction(RET, 0, 0, verdict)


def _argument_block(condition: Condition, refused: Instruction) -> list[Instruction]:
    """Load the condition's argument and return a verdict on every path (the number is gone from
    the accumulator, so the block cannot fall through to the next rule)."""
    allowed = _return(RET_ALLOW)
    load = Instruction(LD_ABS, 0, 0, argument_offset(condition.index))
    if isinstance(condition, AnyFlag):
        return [load, Instruction(JSET, 0, 1, condition.mask), refused, allowed]
    # One comparison per value; a match jumps to the first of two returns, no match reaches the second.
    count = len(condition.values)
    compare = [Instruction(JEQ, count - 1 - i, 0, value) for i, value in enumerate(condition.values[:-1])]
    compare.append(Instruction(JEQ, 0, 1, condition.values[-1]))
    on_match, otherwise = (refused, allowed) if isinstance(condition, OneOf) else (allowed, refused)
    return [load, *compare, on_match, otherwise]


def argument_offset(index: int, byteorder: str = sys.byteorder) -> int:
    """Where the low 32 bits of argument `index` sit in struct seccomp_data."""
    return ARGS_OFFSET + 8 * index + (4 if byteorder == "big" else 0)


def encode(code: Sequence[Instruction]) -> bytes:
    """The program as the kernel reads it: an array of struct sock_filter (native byte order)."""
    for instruction in code:
        if instruction.jt > MAX_JUMP or instruction.jf > MAX_JUMP:
            raise ValueError(f"jump too far in {instruction}")
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in code)


def arch_named(machine: str, pointer_bytes: int) -> Arch | None:
    """The architecture whose system calls a process of `machine` (uname's) with pointers of
    `pointer_bytes` makes, or None where the filter has no table for it (a 32-bit interpreter on
    a 64-bit kernel makes the 32-bit architecture's calls)."""
    name = _MACHINES.get(machine.lower())
    return ARCHES[name] if name is not None and pointer_bytes == 8 else None


# --- what changes a process -----------------------------------------------------------------

_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_FILTER_FLAG_TSYNC = 1


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def native_arch() -> Arch | None:
    """This process's architecture (see arch_named)."""
    return arch_named(os.uname().machine, struct.calcsize("P"))


def unavailable_reason() -> str | None:
    """Why this process cannot be given a seccomp filter here, or None if it can: the check
    systemd makes (PR_SET_SECCOMP with no program fails with EFAULT where filters exist; EINVAL:
    a kernel without them; EPERM or ENOSYS: an outer sandbox refusing the call)."""
    if native_arch() is None:
        return f"no system call table for {os.uname().machine} ({8 * struct.calcsize('P')}-bit)"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, None, 0, 0) == 0:
        return "PR_SET_SECCOMP took no program"  # not a kernel this code knows
    refusal = ctypes.get_errno()
    return None if refusal == errno.EFAULT else f"PR_SET_SECCOMP: {errno.errorcode.get(refusal, refusal)}"


def install(instructions: Sequence[Instruction]) -> None:
    """Load `instructions` as a seccomp filter on every thread of this process, for good (and on all it
    starts). no_new_privs must be set first unless the process holds CAP_SYS_ADMIN. OSError if
    the kernel refuses it."""
    arch = native_arch()
    if arch is None:
        raise OSError(errno.ENOSYS, f"no seccomp filter for {os.uname().machine}")
    encoded = encode(instructions)
    buffer = ctypes.create_string_buffer(encoded, len(encoded))
    fprog = _SockFprog(len(instructions), ctypes.cast(buffer, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    # seccomp(2) with TSYNC: threads started before (a device runtime's) get it too; prctl's
    # form (kernels before 3.17) reaches the calling thread only.
    result = libc.syscall(
        ctypes.c_long(arch.numbers["seccomp"]),
        ctypes.c_uint(_SECCOMP_SET_MODE_FILTER),
        ctypes.c_uint(_SECCOMP_FILTER_FLAG_TSYNC),
        ctypes.byref(fprog),
    )
    if result < 0 and ctypes.get_errno() == errno.ENOSYS:
        result = libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0)
    if result < 0:
        refusal = ctypes.get_errno()
        raise OSError(refusal, f"installing the seccomp filter: {errno.errorcode.get(refusal, refusal)}")
    if result > 0:
        raise OSError(errno.EBUSY, f"thread {result} could not take the seccomp filter (TSYNC)")
