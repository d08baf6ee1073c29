"""A Redis primary, its replicas and three Sentinels on loopback ports: real processes, for the
failover tests (tests/faults/test_failover.py) and for trying Sentinel by hand:

    .venv/bin/python scripts/sentinel_cluster.py /tmp/sentinels     # prints the MRC_ settings, Ctrl-C stops

Every node runs with `min-replicas-to-write 1`: a primary cut off from its replicas (stopped, or on the
wrong side of a partition) refuses writes instead of accepting ones the failover will throw away.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402 - after sys.path is set

from scripts.devservices import Service, free_port, stop, wait_for  # noqa: E402 - after sys.path is set

MASTER = "mrc-primary"


def _client(port: int) -> redis.Redis:
    return redis.Redis(
        host="127.0.0.1", port=port, socket_timeout=2, socket_connect_timeout=2, decode_responses=True
    )


@dataclass
class SentinelCluster:
    workdir: Path
    nodes: list[Service] = field(default_factory=list)  # nodes[0] starts as the primary
    sentinels: list[Service] = field(default_factory=list)
    down_after_ms: int = 1000

    def env(self, db: int = 0) -> dict[str, str]:
        """The MRC_ settings that point a process at this cluster through its Sentinels."""
        return {
            "MRC_REDIS_SENTINELS": ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels),
            "MRC_REDIS_SENTINEL_MASTER": MASTER,
            # The host is not used once Sentinels are set (the db number is): port 1 proves it.
            "MRC_REDIS_URL": f"redis://127.0.0.1:1/{db}",
        }

    def master_port(self) -> int | None:
        """The primary's port as a majority of the live Sentinels name it now."""
        votes: dict[int, int] = {}
        for sentinel in self.sentinels:
            if sentinel.proc.poll() is not None:
                continue
            try:
                reply = _client(sentinel.port).execute_command("SENTINEL", "get-master-addr-by-name", MASTER)
            except redis.RedisError:
                continue
            if reply:
                port = int(reply[1])
                votes[port] = votes.get(port, 0) + 1
        best = max(votes.items(), key=lambda kv: kv[1], default=None)
        return best[0] if best and best[1] >= 2 else None

    def node(self, port: int) -> Service:
        return next(n for n in self.nodes if n.port == port)

    def role(self, port: int) -> str:
        """master or slave, as the node itself says."""
        return str(_client(port).execute_command("ROLE")[0])

    def replicas_in_sync(self, port: int) -> int:
        """How many replicas follow the node at `port` and are in sync with it."""
        return _connected_replicas(port)

    def wait_for_new_master(self, old_port: int, timeout: float = 60) -> int:
        """Block until the Sentinels agree on a master other than `old_port`; its port."""
        found: list[int] = []

        def promoted() -> bool:
            port = self.master_port()
            if port is not None and port != old_port:
                found.append(port)
                return True
            return False

        wait_for(promoted, timeout, "a Sentinel failover")
        return found[-1]

    def stop(self) -> None:
        for service in [*self.sentinels, *self.nodes]:
            if service.proc.poll() is None:
                with_continue(service)
                stop(service.proc, signal.SIGKILL)


def with_continue(service: Service) -> None:
    """A SIGSTOPped process cannot act on SIGTERM: wake it first."""
    with contextlib.suppress(ProcessLookupError):
        service.proc.send_signal(signal.SIGCONT)


def _start(args: list[str], workdir: Path, name: str, port: int) -> Service:
    log_path = workdir / f"{name}.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT)
    service = Service(proc, f"redis://127.0.0.1:{port}/0", port, log_path)

    def up() -> bool:
        # This process's own line first (a data node's, or a Sentinel's once it runs): a PING another
        # test's server on the same port answers must not pass for this one (scripts/devservices.py).
        said = log_path.read_bytes()
        if b"Ready to accept connections" not in said and b"Sentinel ID is" not in said:
            return False
        return bool(_client(port).ping())

    try:
        wait_for(up, 20, name, proc)
    except BaseException:
        stop(proc, signal.SIGKILL)
        raise
    return service


def start(workdir: Path, replicas: int = 2, sentinels: int = 3, down_after_ms: int = 1000) -> SentinelCluster:
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed (make install puts it there through apt)")
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = SentinelCluster(workdir, down_after_ms=down_after_ms)
    try:
        primary = free_port()
        for index in range(1 + replicas):
            port = primary if index == 0 else free_port()
            args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir), "--save", "",
                    "--appendonly", "no", "--dbfilename", f"dump-{port}.rdb",
                    "--min-replicas-to-write", "1", "--min-replicas-max-lag", "2",
                    "--repl-ping-replica-period", "1", "--repl-diskless-sync-delay", "0"]  # fmt: skip
            if index:
                args += ["--replicaof", "127.0.0.1", str(primary)]
            cluster.nodes.append(_start(args, workdir, f"redis-{port}", port))
        wait_for(lambda: _connected_replicas(primary) >= replicas, 30, "the replicas to sync")
        for _ in range(sentinels):
            port = free_port()
            conf = workdir / f"sentinel-{port}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {workdir}\n"
                f"sentinel monitor {MASTER} 127.0.0.1 {primary} 2\n"
                f"sentinel down-after-milliseconds {MASTER} {down_after_ms}\n"
                f"sentinel failover-timeout {MASTER} 4000\n"
                f"sentinel parallel-syncs {MASTER} 1\n"
            )
            cluster.sentinels.append(
                _start([exe, str(conf), "--sentinel"], workdir, f"sentinel-{port}", port)
            )
        wait_for(lambda: cluster.master_port() == primary, 30, "the Sentinels to agree on the primary")
        wait_for(lambda: _sentinels_known(cluster) >= sentinels - 1, 30, "the Sentinels to find each other")
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _connected_replicas(port: int) -> int:
    """Replicas in sync (online), not merely connected: the initial transfer comes first."""
    info = _client(port).info("replication")
    return sum(1 for key, value in info.items() if key.startswith("slave") and isinstance(value, dict)
               and value.get("state") == "online")  # fmt: skip


def _sentinels_known(cluster: SentinelCluster) -> int:
    """How many other Sentinels the first one knows (a failover needs their votes)."""
    reply = _client(cluster.sentinels[0].port).execute_command("SENTINEL", "master", MASTER)
    fields = dict(zip(reply[::2], reply[1::2], strict=True)) if isinstance(reply, list) else dict(reply)
    return int(fields.get("num-other-sentinels", 0))


def main() -> None:
    workdir = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/mrc-sentinels")
    cluster = start(workdir)
    for name, value in cluster.env().items():
        print(f"export {name}={value}", flush=True)
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # SIGTERM too: review (six Redis left)
        signal.signal(sig, lambda *_: stopped.set())
    try:
        stopped.wait()
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
