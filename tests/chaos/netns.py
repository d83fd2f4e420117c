"""Two "nodes" as Linux network namespaces joined by one veth pair, for the network chaos tests
(``tests/chaos/test_network_faults.py``): each node has its own hostname (``unshare --uts``), a hosts file naming
both nodes (``/etc/netns/NAME/hosts``, bind-mounted by ``ip netns exec``), loopback up, and one address on its veth
end. No interface, route or address outside the two namespaces: traffic between the nodes crosses only the veth
pair, which the tests can rate-limit (``tc ... tbf``) or take down (a partition).

Everything is named after a random tag, so runs never collide; ``destroy()`` stops every process still inside
the namespaces (by PID, from ``ip netns pids``), deletes both namespaces (which deletes the veth pair) and their
``/etc/netns`` folders. It is idempotent and safe to call after a partial ``create()``.

By hand (as root; what the tests do)::

    python tests/chaos/netns.py demo /tmp/h5/clean    # a clean 2-node ``dtprobe run`` across the namespaces
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NETNS_ETC = Path("/etc/netns")
SUBNET_PREFIX = "10.213.77"
"""The /30 both veth ends live in; it exists only inside the two namespaces this module creates."""
RDZV_PORT = 29400
"""The c10d rendezvous port on node 0 (free by construction: node 0's namespace is new)."""
_CMD_TIMEOUT_S = 20


class NetnsError(RuntimeError):
    """A precondition or an ``ip``/``tc`` command failed; the message says what and how to fix it."""


@dataclass(frozen=True)
class Node:
    """One side of the link."""

    index: int
    """Node rank (0 hosts the rendezvous store)."""
    ns: str
    """Network namespace name."""
    hostname: str
    """Hostname inside the node's UTS namespace (also in both hosts files)."""
    veth: str
    """This node's end of the veth pair."""
    addr: str
    """This node's IPv4 address on ``veth``."""


def missing_preconditions() -> list[str]:
    """What this machine lacks to build the two nodes, each with its fix; empty when all is there."""
    out = []
    if os.geteuid() != 0:
        out.append("network namespaces need root: run the chaos tests as root (CI runs as root), "
                   "e.g. `sudo -E python -m pytest tests/chaos/test_network_faults.py`")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("unshare", "util-linux"),
                          ("hostname", "hostname"), ("timeout", "coreutils")):
        if shutil.which(tool) is None:
            out.append(f"`{tool}` is not on PATH: `apt-get install {package}`")
    return out


def _sh(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


class TwoNodes:
    """Two namespaces ``dtpc<tag>n0``/``dtpc<tag>n1`` joined by veth ``dtpc<tag>v0``/``dtpc<tag>v1``."""

    def __init__(self, tag: str | None = None) -> None:
        tag = tag or secrets.token_hex(3)
        self.tag = tag
        self.nodes = tuple(Node(index=i, ns=f"dtpc{tag}n{i}", hostname=f"dtpc{tag}-node{i}",
                                veth=f"dtpc{tag}v{i}", addr=f"{SUBNET_PREFIX}.{i + 1}") for i in range(2))
        self.procs: list[subprocess.Popen] = []

    # ------------------------------------------------------------------ lifecycle
    def create(self) -> "TwoNodes":
        missing = missing_preconditions()
        if missing:
            raise NetnsError("cannot build the two network namespaces: " + "; ".join(missing))
        n0, n1 = self.nodes
        hosts = "127.0.0.1 localhost\n" + "".join(f"{n.addr} {n.hostname}\n" for n in self.nodes)
        for n in self.nodes:
            proc = _sh(["ip", "netns", "add", n.ns], check=False)
            if proc.returncode != 0:
                raise NetnsError(f"`ip netns add {n.ns}` failed: {proc.stderr.strip()}; the chaos tests need root with "
                                 f"CAP_SYS_ADMIN and CAP_NET_ADMIN (a container needs --privileged or --cap-add "
                                 f"SYS_ADMIN --cap-add NET_ADMIN).")
            (NETNS_ETC / n.ns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / n.ns / "hosts").write_text(hosts)
            _sh(["ip", "-n", n.ns, "link", "set", "lo", "up"])
        _sh(["ip", "link", "add", n0.veth, "netns", n0.ns, "type", "veth", "peer", "name", n1.veth, "netns", n1.ns])
        for n in self.nodes:
            _sh(["ip", "-n", n.ns, "addr", "add", f"{n.addr}/30", "dev", n.veth])
            _sh(["ip", "-n", n.ns, "link", "set", n.veth, "up"])
        self.ping(timeout_s=10)
        return self

    def ping(self, *, timeout_s: float) -> None:
        """Wait until node 0 reaches node 1 over the veth pair: a TCP connect to a closed port there is refused
        (the round trip crossed the link); raises when it does not within ``timeout_s``."""
        n0, n1 = self.nodes
        deadline = time.monotonic() + timeout_s
        probe = [sys.executable, "-c",
                 "import socket,sys; s=socket.socket(); s.settimeout(1); "
                 "sys.exit(0 if s.connect_ex((sys.argv[1], 9)) in (0, 111) else 1)", n1.addr]
        while True:
            if _sh(["ip", "netns", "exec", n0.ns, *probe], check=False).returncode == 0:
                return
            if time.monotonic() > deadline:
                raise NetnsError(f"{n0.ns} cannot reach {n1.addr} over {n0.veth}<->{n1.veth} after {timeout_s:g} s; "
                                 f"check `ip -n {n0.ns} addr` and `ip -n {n1.ns} link`.")
            time.sleep(0.2)

    def destroy(self) -> list[str]:
        """Stop what still runs in the namespaces, delete them and their /etc/netns folders. Returns the problems
        met (empty when clean), so a finalizer can report them without masking the test's own failure."""
        problems = []
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for n in self.nodes:
            for pid in self.pids(n):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                problems.append(f"pid {proc.pid} did not exit after SIGKILL")
        for n in self.nodes:
            deadline = time.monotonic() + 10
            while self.pids(n) and time.monotonic() < deadline:
                time.sleep(0.1)
            if Path("/run/netns", n.ns).exists():
                proc = _sh(["ip", "netns", "del", n.ns], check=False)
                if proc.returncode != 0:
                    problems.append(f"`ip netns del {n.ns}`: {proc.stderr.strip()}")
            shutil.rmtree(NETNS_ETC / n.ns, ignore_errors=True)
        return problems

    def __enter__(self) -> "TwoNodes":
        try:
            return self.create()
        except BaseException:
            self.destroy()
            raise

    def __exit__(self, *exc: object) -> None:
        problems = self.destroy()
        if problems and exc[0] is None:
            raise NetnsError("cleanup of the network namespaces failed: " + "; ".join(problems))

    @staticmethod
    def pids(node: Node) -> list[int]:
        if not Path("/run/netns", node.ns).exists():
            return []
        out = _sh(["ip", "netns", "pids", node.ns], check=False).stdout
        return [int(p) for p in out.split()]

    # ------------------------------------------------------------------ processes
    def popen(self, node: Node, argv: list[str], *, env: dict[str, str], log: Path,
              timeout_s: float) -> subprocess.Popen:
        """Start ``argv`` on ``node``: in its network namespace (with its hosts file), its own UTS namespace
        with the node's hostname, and ``GLOO_SOCKET_IFNAME`` set to its veth end; ``timeout(1)`` ends it after
        ``timeout_s`` (the processes it started in their own sessions are ``destroy()``'s). Output goes to ``log``."""
        env = {**env, "GLOO_SOCKET_IFNAME": node.veth}
        wrapped = ["timeout", "-k", "5", f"{timeout_s:g}", "ip", "netns", "exec", node.ns, "unshare", "--uts", "--",
                   "sh", "-c", 'hostname "$0" && exec "$@"', node.hostname, *argv]
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(wrapped, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def dtprobe_run(self, run_dir: Path, args: list[str], *, nproc: int = 1, env: dict[str, str] | None = None,
                    logs: Path, timeout_s: float = 300) -> list[subprocess.Popen]:
        """One ``dtprobe run --nnodes 2`` launcher per node (each ended by ``timeout(1)`` after ``timeout_s``),
        rendezvous on node 0's hostname; launcher output in ``logs/launcher.node<K>.log``."""
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **(env or {})}
        endpoint = f"{self.nodes[0].hostname}:{RDZV_PORT}"
        return [self.popen(n, [sys.executable, "-m", "dtprobe.cli", "run", "--run-dir", str(run_dir),
                               "--nnodes", "2", "--node-rank", str(n.index), "--nproc", str(nproc),
                               "--rdzv-endpoint", endpoint, *args], env=env, log=logs / f"launcher.node{n.index}.log",
                           timeout_s=timeout_s)
                for n in self.nodes]

    # ------------------------------------------------------------------ faults
    def rate_limit(self, *, rate: str, burst: str, latency: str) -> None:
        """Shape both directions of the link with a token bucket (``tc qdisc add dev VETH root tbf``)."""
        for n in self.nodes:
            _sh(["ip", "netns", "exec", n.ns, "tc", "qdisc", "add", "dev", n.veth, "root", "tbf",
                 "rate", rate, "burst", burst, "latency", latency])

    def link_down(self, node: Node) -> None:
        """Take ``node``'s veth end down: the two nodes can no longer reach each other (a partition)."""
        _sh(["ip", "-n", node.ns, "link", "set", node.veth, "down"])

    def link_up(self, node: Node) -> None:
        """Bring ``node``'s veth end back up (heals a partition)."""
        _sh(["ip", "-n", node.ns, "link", "set", node.veth, "up"])


def wait_for_rows(path: Path, *, num_rows: int, timeout_s: float, procs: list[subprocess.Popen]) -> int:
    """Wait until the JSONL file ``path`` holds ``num_rows`` complete lines; returns the count. Raises when a
    process in ``procs`` exits first or ``timeout_s`` passes (the message names the file)."""
    deadline = time.monotonic() + timeout_s
    count = 0
    while True:
        try:
            count = path.read_bytes().count(b"\n")
        except FileNotFoundError:
            count = 0
        if count >= num_rows:
            return count
        exited = [p.pid for p in procs if p.poll() is not None]
        if exited:
            raise NetnsError(f"launcher(s) {exited} exited before {path} reached {num_rows} rows ({count})")
        if time.monotonic() > deadline:
            raise NetnsError(f"{path} has {count} of {num_rows} rows after {timeout_s:g} s")
        time.sleep(0.2)


def wait_all(procs: list[subprocess.Popen], *, timeout_s: float) -> list[int]:
    """Exit codes of ``procs``; raises after ``timeout_s`` (the caller's finalizer kills what is left)."""
    deadline = time.monotonic() + timeout_s
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            raise NetnsError(f"pid {p.pid} ({' '.join(p.args[-12:])}) still runs after {timeout_s:g} s") from None
    return codes


def _demo(run_dir: str) -> None:
    run_dir_path = Path(run_dir)
    with TwoNodes() as link:
        print("nodes:", link.nodes, flush=True)
        procs = link.dtprobe_run(run_dir_path, ["--steps", "10", "--timeout", "60"],
                                 logs=run_dir_path.parent / f"{run_dir_path.name}.logs")
        print("exit codes:", wait_all(procs, timeout_s=150), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "demo":
        _demo(sys.argv[2])
    else:
        sys.exit(__doc__)
