"""gpu_manager.seccomp: the program's verdicts (read by a small classic-BPF interpreter, for both
architectures), then the same program in a real process: each refused call fails with its errno,
threads, children and torch keep working, and a foreign architecture's call kills the process."""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import platform
import re
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from gpu_manager import seccomp
from gpu_manager.sandbox import no_new_privileges
from gpu_manager.seccomp import (
    ARCHES,
    AUDIT_ARCH_X86_64,
    JEQ,
    JGE,
    JSET,
    LD_ABS,
    RET,
    RET_ALLOW,
    RET_ERRNO,
    RET_KILL_PROCESS,
    RULES,
    Arch,
    Instruction,
)

REPO = Path(__file__).resolve().parents[2]
AUDIT_ARCH_I386 = 0x40000003
# What a worker must never be able to do, whatever else the list gains or loses.
MUST_REFUSE = {
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "unshare",
    "setns",
    "mount",
    "pivot_root",
    "chroot",
    "clone3",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "keyctl",
    "init_module",
    "finit_module",
    "kexec_load",
    "io_uring_setup",
    "open_by_handle_at",
}
NATIVE = seccomp.native_arch()
needs_native = pytest.mark.skipif(
    NATIVE is None or seccomp.unavailable_reason() is not None, reason="no seccomp filter on this machine"
)


def verdict(code: Sequence[Instruction], *, arch: int, nr: int, args: Sequence[int] = ()) -> int:
    """Run `code` on one call (struct seccomp_data, native byte order), as the kernel would."""
    padded = [*args, *[0] * (6 - len(args))]
    data = struct.pack("=iIQ6Q", nr, arch, 0, *padded)
    pc, accumulator = 0, 0
    while True:
        instruction = code[pc]
        if instruction.code == RET:
            return instruction.k
        if instruction.code == LD_ABS:
            (accumulator,) = struct.unpack_from("=I", data, instruction.k)
            pc += 1
            continue
        taken = {
            JEQ: accumulator == instruction.k,
            JGE: accumulator >= instruction.k,
            JSET: accumulator & instruction.k != 0,
        }[instruction.code]
        pc += 1 + (instruction.jt if taken else instruction.jf)


def refused(code: int = errno.EPERM) -> int:
    return RET_ERRNO | code


@pytest.mark.parametrize("arch", ARCHES.values(), ids=list(ARCHES))
def test_each_listed_call_is_refused_and_the_rest_allowed(arch: Arch) -> None:
    code = seccomp.program(arch)
    for rule in RULES:
        if rule.name in arch.numbers and rule.when is None:
            assert verdict(code, arch=arch.audit_arch, nr=arch.numbers[rule.name]) == refused(rule.errno), rule.name
    assert verdict(code, arch=arch.audit_arch, nr=arch.numbers["clone3"]) == refused(errno.ENOSYS)
    listed = {arch.numbers[rule.name] for rule in RULES if rule.name in arch.numbers}
    unlisted = [nr for nr in range(512) if nr not in listed]
    assert len(unlisted) > 400
    for nr in unlisted:  # read, openat, futex, mmap, execve, ... and numbers no call has
        assert verdict(code, arch=arch.audit_arch, nr=nr) == RET_ALLOW, nr


@pytest.mark.parametrize("arch", ARCHES.values(), ids=list(ARCHES))
def test_clone_personality_and_socket_are_judged_by_their_argument(arch: Arch) -> None:
    code = seccomp.program(arch)

    def judged(name: str, first: int) -> int:
        return verdict(code, arch=arch.audit_arch, nr=arch.numbers[name], args=[first])

    thread = 0x003D0F00  # CLONE_VM | CLONE_FS | CLONE_FILES | CLONE_SIGHAND | CLONE_THREAD | ... (glibc's)
    assert judged("clone", thread) == RET_ALLOW
    assert judged("clone", 0x01200011) == RET_ALLOW  # fork: SIGCHLD | CLONE_CHILD_SETTID | CLEARTID
    for flag in (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000):
        assert judged("clone", 0x11 | flag) == refused(), hex(flag)
    assert judged("clone", (1 << 32) | 0x11) == RET_ALLOW  # the kernel reads 32 bits of clone's flags
    for allowed in (0, 8, 0x20000, 0x20008, 0xFFFFFFFF):
        assert judged("personality", allowed) == RET_ALLOW
    for other in (0x0040000, 0x0400000, 0x1):  # ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC, PER_SVR4
        assert judged("personality", other) == refused()
    assert judged("socket", 40) == refused()  # AF_VSOCK
    for family in (1, 2, 10, 16):  # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK
        assert judged("socket", family) == RET_ALLOW


def test_another_architecture_is_killed_and_x32_calls_refused() -> None:
    x86_64, aarch64 = ARCHES["x86_64"], ARCHES["aarch64"]
    code = seccomp.program(x86_64)
    getpid = 39  # x86_64's
    assert verdict(code, arch=AUDIT_ARCH_X86_64, nr=getpid) == RET_ALLOW
    assert verdict(code, arch=AUDIT_ARCH_I386, nr=20) == RET_KILL_PROCESS  # i386 getpid (int 0x80)
    assert verdict(code, arch=aarch64.audit_arch, nr=getpid) == RET_KILL_PROCESS
    for nr in (0x40000000 | getpid, 0x40000000 | 521, 0x7FFFFFFF):  # x32 getpid, x32 ptrace
        assert verdict(code, arch=AUDIT_ARCH_X86_64, nr=nr) == refused(errno.ENOSYS)
    arm = seccomp.program(aarch64)
    assert verdict(arm, arch=0x40000028, nr=26) == RET_KILL_PROCESS  # AArch32 (compat) ptrace
    assert verdict(arm, arch=aarch64.audit_arch, nr=0x40000000 | 117) == RET_ALLOW  # no such call: ENOSYS


def test_losing_a_call_from_the_deny_list_fails_here() -> None:
    names = {rule.name for rule in RULES}
    assert names >= MUST_REFUSE, MUST_REFUSE - names
    for arch in ARCHES.values():
        code = seccomp.program(arch)
        for name in MUST_REFUSE:
            assert verdict(code, arch=arch.audit_arch, nr=arch.numbers[name]) != RET_ALLOW, (arch.name, name)
    assert (
        verdict(
            seccomp.program(ARCHES["x86_64"], [r for r in RULES if r.name != "ptrace"]), arch=AUDIT_ARCH_X86_64, nr=101
        )
        == RET_ALLOW
    )


HEADERS = {
    "x86_64": Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
    "aarch64": Path("/usr/include/asm-generic/unistd.h"),  # arm64 uses the generic table
}


@pytest.mark.parametrize("name", list(HEADERS))
def test_the_numbers_are_the_kernels(name: str) -> None:
    header = HEADERS[name]
    if not header.exists():
        pytest.skip(f"no {header} here")
    defined = {m[1]: int(m[2]) for m in re.finditer(r"#define __NR_(\w+)\s+(\d+)", header.read_text())}
    table = ARCHES[name].numbers
    checked = [call for call in table if call in defined]  # a header older than a call lacks it
    assert len(checked) >= len(table) - 3
    assert {call: table[call] for call in checked} == {call: defined[call] for call in checked}
    if name == "x86_64":
        assert {"iopl", "ioperm", "uselib"} <= set(table)
    else:
        assert not {"iopl", "ioperm", "uselib"} & set(table)


def test_the_architecture_is_the_interpreters_not_the_kernels() -> None:
    assert seccomp.arch_named("x86_64", 8) is ARCHES["x86_64"]
    assert seccomp.arch_named("arm64", 8) is ARCHES["aarch64"]
    assert seccomp.arch_named("x86_64", 4) is None  # a 32-bit interpreter makes i386 (or x32) calls
    assert seccomp.arch_named("ppc64le", 8) is None
    encoded = seccomp.encode(seccomp.program(ARCHES["x86_64"]))
    assert len(encoded) == 8 * len(seccomp.program(ARCHES["x86_64"]))
    assert struct.unpack_from("=HBBI", encoded) == (LD_ABS, 0, 0, 4)  # the architecture, first


# --- in a real process ------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

# Each refused call with arguments that would do no harm were it let through (the tests may run
# as root): an invalid flag, a bad descriptor or a NULL pointer, or a no-op.
PROBES: dict[str, tuple[int | bytes, ...]] = {
    "ptrace": (0xFFFF, 0),
    "process_vm_readv": (0, 0, 0, 0, 0, 0),
    "process_vm_writev": (0, 0, 0, 0, 0, 0),
    "kcmp": (0, 0, 99, 0, 0),
    "pidfd_getfd": (-1, 0, 0),
    "process_madvise": (-1, 0, 0, 0, 0),
    "unshare": (0,),  # a no-op, let through
    "setns": (-1, 0),
    "mount": (0, 0, 0, 0, 0),
    "umount2": (0, 0),
    "pivot_root": (0, 0),
    "chroot": (0,),
    "open_tree": (-1, 0, 0),
    "open_tree_attr": (-1, 0, 0, 0, 0),
    "move_mount": (-1, 0, -1, 0, 0),
    "fsopen": (0, 0),
    "fsconfig": (-1, 0, 0, 0, 0),
    "fsmount": (-1, 0, 0),
    "fspick": (-1, 0, 0),
    "mount_setattr": (-1, 0, 0, 0, 0),
    "clone": (0x10000000 | 0x200, 0, 0, 0, 0),  # CLONE_NEWUSER | CLONE_FS: EINVAL, let through
    "clone3": (0, 0),
    "init_module": (0, 0, 0),
    "finit_module": (-1, 0, 0),
    "delete_module": (0, 0),
    "kexec_load": (0, 0xFFFF, 0, 0xFFFFFFFF),
    "kexec_file_load": (-1, -1, 0, 0, 0xFF),
    "bpf": (0xFFFF, 0, 0),
    "perf_event_open": (0, 0, -1, -1, 0),
    "userfaultfd": (0xFFFFFFFF,),
    "iopl": (0,),
    "ioperm": (0, 0, 0),
    "lookup_dcookie": (0, 0, 0),
    "uselib": (0,),
    "io_uring_setup": (0, 0),
    "io_uring_enter": (-1, 0, 0, 0, 0, 0),
    "io_uring_register": (-1, 0, 0, 0),
    "keyctl": (0xFFFF, 0, 0, 0, 0),
    "add_key": (0, 0, 0, 0, 0),
    "request_key": (0, 0, 0, 0),
    "acct": (b"/nonexistent/acct",),
    "swapon": (0, 0),
    "swapoff": (0,),
    "reboot": (0, 0, 0, 0),  # no magic numbers: EINVAL
    "syslog": (0, 0, 0),  # SYSLOG_ACTION_CLOSE: a no-op
    "quotactl": (0, 0, 0, 0),
    "quotactl_fd": (-1, 0, 0, 0),
    "settimeofday": (0, 0),  # both NULL: a no-op
    "clock_settime": (0xFFFF, 0),
    "adjtimex": (0,),
    "clock_adjtime": (0xFFFF, 0),
    "sethostname": (0, 1 << 20),  # too long: EINVAL
    "setdomainname": (0, 1 << 20),
    "open_by_handle_at": (-1, 0, 0),
    "name_to_handle_at": (-1, 0, 0, 0, 0),
    "fanotify_init": (0xFFFFFFFF, 0),
    "personality": (0x0040000,),  # ADDR_NO_RANDOMIZE
    "socket": (40, 1, 0),  # AF_VSOCK
}


def raw_call(number: int, *args: int | bytes) -> int:
    """The system call's result: 0 or more, or minus its errno."""
    converted = [ctypes.c_char_p(a) if isinstance(a, bytes) else ctypes.c_long(a) for a in args]
    result = int(_libc.syscall(ctypes.c_long(number), *converted))
    return result if result >= 0 else -ctypes.get_errno()


def in_child(body: Callable[[], object]) -> tuple[int, object]:
    """Run `body` in a forked child; its wait status and what it returned (JSON)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            os.write(write_end, json.dumps(body()).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as report:
        output = report.read()
    _, status = os.waitpid(pid, 0)
    return status, json.loads(output) if output else None


def seccomp_mode() -> str:
    """This process's seccomp mode (/proc/self/status): "0" none, "2" a filter."""
    found = re.search(r"^Seccomp:\s+(\d)", Path("/proc/self/status").read_text(), re.MULTILINE)
    return found[1] if found else "unknown"


def test_probes_cover_every_rule() -> None:
    assert set(PROBES) == {rule.name for rule in RULES}


@needs_native
def test_in_a_real_process_each_refused_call_fails_and_threads_and_children_work() -> None:
    assert NATIVE is not None
    probes = {name: args for name, args in PROBES.items() if name in NATIVE.numbers}

    def body() -> object:
        unfiltered = {name: raw_call(NATIVE.numbers[name], *args) for name, args in probes.items()}
        no_new_privileges()
        seccomp.install(seccomp.program(NATIVE))
        filtered = {name: raw_call(NATIVE.numbers[name], *args) for name, args in probes.items()}
        child = os.fork()  # clone without namespace flags
        if child == 0:
            os._exit(3)
        _, child_status = os.waitpid(child, 0)
        seen: list[int] = []
        # A thread: clone3 is refused with ENOSYS, and glibc falls back to clone.
        thread = threading.Thread(target=lambda: seen.append(threading.get_native_id()))
        thread.start()
        thread.join()
        return {
            "unfiltered": unfiltered,
            "filtered": filtered,
            "child": os.waitstatus_to_exitcode(child_status),
            "thread": len(seen),
            "exec": subprocess.run(["true"], check=False).returncode,  # fork (or vfork) and execve
            "personality": _libc.personality(0xFFFFFFFF),  # the query is allowed
            "unix_socket": raw_call(NATIVE.numbers["socket"], 1, 1, 0) >= 0,
            "seccomp": seccomp_mode(),
        }

    status, report = in_child(body)
    assert os.WIFEXITED(status) and isinstance(report, dict), status
    expected = {name: -rule.errno for rule in RULES if (name := rule.name) in probes}
    assert report["filtered"] == expected, {"unfiltered": report["unfiltered"]}
    assert report["unfiltered"]["unshare"] == 0 and report["unfiltered"]["clone3"] == -errno.EINVAL
    assert report["child"] == 3 and report["thread"] == 1 and report["exec"] == 0
    assert report["personality"] >= 0 and report["unix_socket"] and report["seccomp"] == "2"


I386_GETPID = bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3])  # mov eax, 20; int 0x80; ret


def i386_getpid() -> int:
    """getpid through the i386 entry (int 0x80) from this 64-bit process."""
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(I386_GETPID)
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    return int(ctypes.CFUNCTYPE(ctypes.c_int)(address)())


@needs_native
@pytest.mark.skipif(platform.machine() != "x86_64", reason="i386 calls exist on x86_64 only")
def test_a_call_through_the_i386_entry_kills_the_process() -> None:
    status, unfiltered = in_child(lambda: i386_getpid() == os.getpid())
    if not (os.WIFEXITED(status) and unfiltered):
        pytest.skip("this kernel runs no i386 calls (no IA32 emulation)")
    assert NATIVE is not None

    def body() -> object:
        no_new_privileges()
        seccomp.install(seccomp.program(NATIVE))
        return i386_getpid()

    status, _ = in_child(body)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSYS, status


TORCH_UNDER_THE_FILTER = r"""
import json, os, subprocess, sys, threading
sys.path.insert(0, sys.argv[1])
from gpu_manager import seccomp
from gpu_manager.sandbox import no_new_privileges
no_new_privileges()
seccomp.install(seccomp.program(seccomp.native_arch()))
import torch  # imported under the filter, as a handler's own imports are
torch.set_num_threads(2)
ones = torch.ones(256, 256)
product = ones @ ones
threads = []
results = []
for _ in range(4):
    thread = threading.Thread(target=lambda: results.append(float((torch.randn(64, 64) @ torch.eye(64)).sum())))
    thread.start()
    threads.append(thread)
for thread in threads:
    thread.join()
child = os.fork()
if child == 0:
    os._exit(int((torch.ones(2) * 2).sum()))
print(json.dumps({
    "product": float(product[0, 0]),
    "threads": torch.get_num_threads(),
    "thread_results": len(results),
    "child": os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]),
    "exec": subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True, text=True).stdout.strip(),
}))
"""


@needs_native
def test_torch_imports_and_computes_on_several_threads_under_the_filter() -> None:
    out = subprocess.run(
        [sys.executable, "-c", TORCH_UNDER_THE_FILTER, str(REPO)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report == {"product": 256.0, "threads": 2, "thread_results": 4, "child": 4, "exec": "1"}
