"""`baton up`'s restarts: the back-off (pure) and the supervisor over real child processes,
driven by a clock the test moves."""

from __future__ import annotations

import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from baton.local.process_actor import ServerProcess
from baton.local.restart import Backoff, crash_streak, restart_delay
from baton.local.supervisor import Liveness, Supervisor


def test_the_delay_doubles_up_to_the_cap():
    backoff = Backoff(initial_s=1.0, factor=2.0, cap_s=30.0)
    assert [restart_delay(n, backoff) for n in range(1, 9)] == [1, 2, 4, 8, 16, 30, 30, 30]
    assert restart_delay(10**6, backoff) == 30.0  # a long crash loop does not overflow


def test_a_long_run_ends_the_streak():
    backoff = Backoff(healthy_after_s=60.0)
    assert crash_streak(0, 0.5, backoff) == 1
    assert crash_streak(4, 59.0, backoff) == 5
    assert crash_streak(4, 60.0, backoff) == 1


@pytest.mark.parametrize("bad", [dict(initial_s=-1), dict(factor=0.5), dict(cap_s=0.5, initial_s=1.0),
                                 dict(healthy_after_s=-1)])
def test_bad_backoff_is_refused(bad):
    with pytest.raises(ValueError):
        Backoff(**bad)
    with pytest.raises(ValueError):
        restart_delay(0, Backoff())


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def exiting_process(code: int, sleep_s: float = 0.0) -> ServerProcess:
    process = ServerProcess("unused", [], {})
    process.command = [sys.executable, "-c", f"import sys, time; time.sleep({sleep_s}); sys.exit({code})"]
    return process


def test_an_exited_process_is_restarted_after_the_backoff_and_counted():
    clock, said = Clock(), []
    supervisor = Supervisor(Backoff(initial_s=1.0, factor=2.0, cap_s=30.0, healthy_after_s=60.0),
                            said.append, clock=clock)
    process = exiting_process(3)
    first_pid = process.start()
    supervisor.watch("worker-1 (decode)", process)
    process.proc.wait(10)

    clock.now += 5.0
    supervisor.tick()  # the exit is seen: a restart is due in 1 s, not yet started
    assert process.poll() == 3 and supervisor.restarts == {"worker-1 (decode)": 0}
    assert "exited with code 3 after 5.0s; restarting in 1s" in said[-1]
    clock.now += 0.5
    supervisor.tick()
    assert supervisor.restarts["worker-1 (decode)"] == 0
    clock.now += 0.5
    supervisor.tick()
    assert supervisor.restarts["worker-1 (decode)"] == 1 and process.proc.pid != first_pid
    assert "restarted" in said[-1]

    process.proc.wait(10)  # it crashes again at once: the next wait doubles
    clock.now += 0.1
    supervisor.tick()
    assert "restarting in 2s (2 exit(s) in a row)" in said[-1]
    clock.now += 2.0
    supervisor.tick()
    assert supervisor.restarts["worker-1 (decode)"] == 2

    process.proc.wait(10)
    clock.now += 120.0  # it had run long enough: a new streak, the shortest wait
    supervisor.tick()
    assert "restarting in 1s (1 exit(s) in a row)" in said[-1]
    process.stop()


def test_a_running_process_is_left_alone_and_its_return_to_ready_is_logged():
    class Ready(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/ready" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Ready)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    clock, said = Clock(), []
    supervisor = Supervisor(Backoff(initial_s=0.0, cap_s=1.0), said.append, clock=clock)
    process = exiting_process(0, sleep_s=0.0)
    process.start()
    supervisor.watch("router", process, f"http://127.0.0.1:{server.server_port}/ready")
    try:
        process.proc.wait(10)  # exit code 0 restarts too: restartPolicy Always
        supervisor.tick()
        supervisor.tick()
        assert supervisor.restarts == {"router": 1}
        process.command = [sys.executable, "-c", "import time; time.sleep(60)"]  # the next run stays up
        process.proc.wait(10)
        supervisor.tick()
        supervisor.tick()
        assert supervisor.restarts == {"router": 2} and process.poll() is None
        supervisor.tick()
        assert "router is ready again" in said[-1]
        supervisor.tick()
        assert supervisor.restarts == {"router": 2} and len([m for m in said if "ready again" in m]) == 1
    finally:
        process.stop()
        server.shutdown()


def test_a_process_failing_its_liveness_probe_is_stopped_and_restarted():
    """A server that runs but says it is broken (a tensor-parallel worker that lost a rank
    answers /health 503) is restarted after `failures` probes in a row, as a pod would be;
    a probe that passes in between starts the count again."""
    health = {"status": 200}

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(health["status"] if self.path == "/health" else 200)
            self.end_headers()
            self.wfile.write(b'{"status": "failed", "reason": "tensor-parallel rank 1 exited"}')

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"
    clock, said = Clock(), []
    supervisor = Supervisor(Backoff(initial_s=1.0, cap_s=1.0), said.append, clock=clock,
                            liveness=Liveness(period_s=5.0, timeout_s=2.0, failures=3))
    process = exiting_process(0, sleep_s=60)
    first_pid = process.start()
    supervisor.watch("worker-1 (decode)", process, base + "/ready", base + "/health")

    def probe(times: int) -> None:
        for _ in range(times):
            clock.now += 5.0
            supervisor.tick()

    try:
        health["status"] = 503
        probe(2)
        health["status"] = 200
        probe(1)  # passed: the count starts again
        health["status"] = 503
        probe(2)
        assert process.poll() is None and supervisor.restarts["worker-1 (decode)"] == 0
        probe(1)  # the third failure in a row
        assert process.poll() is not None
        assert any("failed its liveness probe 3 times in a row (503" in m and "rank 1" in m for m in said)
        health["status"] = 200
        clock.now += 1.0
        supervisor.tick()
        assert supervisor.restarts["worker-1 (decode)"] == 1 and process.proc.pid != first_pid
        supervisor.tick()
        assert "is ready again" in said[-1]
    finally:
        process.stop()
        server.shutdown()
