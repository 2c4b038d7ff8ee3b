"""The built-in engine against greedy or hostile clients: slow and half-open connections are
closed, connections are capped, the pending queue is bounded, waiting requests are admitted
fairly, and weight-load errors do not tell which host paths exist."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from titan_rl.actors.server import ServerProcess
from titan_rl.engine.cli import build_parser, fit_connections_to_fd_limit, validate
from titan_rl.engine.core import FAIR_QUANTUM, Engine, QueueFullError, Sequence
from titan_rl.engine.sampling import RequestError, parse_sampling_params
from titan_rl.engine.weights import load_safetensors_dir

VOCAB = 300
KEY = "limits-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: generous bound for a socket read that must end (the server closes well before)
WAIT_S = 30.0


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=WAIT_S)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends before closing (raises socket.timeout if it never does)."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def _gen_body(n: int, max_new: int = 2) -> dict:
    return {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": max_new, "n": n, "ignore_eos": True},
    }


# ---- one server with small limits ------------------------------------------------------------

CAP = 16  # --max-connections and --max-queued-requests of the server below


@pytest.fixture(scope="module")
def limited_engine(tiny_model: Path, engine_factory: Callable[..., ServerProcess]) -> ServerProcess:
    return engine_factory(
        tiny_model,
        "limits",
        api_key=KEY,
        extra_args=[
            "--request-read-timeout",
            "1",
            "--max-connections",
            str(CAP),
            "--max-queued-requests",
            str(CAP),
        ],
    )


def _wait_for(condition: Callable[[], bool], tries: int = 400) -> None:
    for _ in range(tries):
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached")


def _queued(client: httpx.Client) -> int:
    return client.get("/get_server_info").json()["num_queued_reqs"]


def _health(url: str) -> int:
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            return client.get("/health").status_code
    except httpx.HTTPError:
        return 0


def test_half_open_connections_are_closed_and_server_answers(
    limited_engine: ServerProcess,
) -> None:
    url = limited_engine.url
    partial_headers = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    slow_body = (
        b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n"
        b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"input_ids"'
    )
    socks = [_connect(url) for _ in range(CAP - 4)]
    for i, sock in enumerate(socks):
        if i % 3 == 1:
            sock.sendall(partial_headers)  # headers never finished, no API key
        elif i % 3 == 2:
            sock.sendall(slow_body)  # a body that never arrives
        # i % 3 == 0: connected, nothing sent
    try:
        replies = [_read_until_closed(sock) for sock in socks]
    finally:
        for sock in socks:
            sock.close()
    assert all(r.startswith(b"HTTP/1.1 408 ") for r in replies), {r[:40] for r in replies}
    assert b"--request-read-timeout" in replies[0]
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        assert client.get("/health").status_code == 200
        r = client.post("/generate", json=_gen_body(1))
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 2


def test_read_timeout_does_not_limit_a_slow_response(limited_engine: ServerProcess) -> None:
    """The deadline covers receiving the request, not generating the answer."""
    url = limited_engine.url
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        assert client.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        result: dict[str, httpx.Response] = {}

        def call() -> None:
            with httpx.Client(base_url=url, headers=AUTH, timeout=60) as other:
                result["r"] = other.post("/generate", json=_gen_body(2))

        worker = threading.Thread(target=call)
        worker.start()
        try:
            _wait_for(lambda: _queued(client) == 2)
            time.sleep(2.5)  # well past the 1 s read timeout while the request waits
        finally:
            assert client.post("/continue_generation", json={}).status_code == 200
            worker.join(60)
    assert result["r"].status_code == 200
    assert [len(o["output_ids"]) for o in result["r"].json()] == [2, 2]


def test_connections_over_the_cap_get_503_and_server_stays_up(
    limited_engine: ServerProcess,
) -> None:
    """CAP connections with whole requests (so the read timeout does not close them) wait on
    a paused engine; one more connection is answered 503 and closed."""
    url = limited_engine.url
    request = (
        b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n"
        b"Content-Type: application/json\r\nConnection: close\r\nContent-Length: "
    )
    body = b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}'
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        assert client.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    held = [_connect(url) for _ in range(CAP)]
    try:
        for sock in held:
            sock.sendall(request + str(len(body)).encode() + b"\r\n\r\n" + body)
        extra = _connect(url)  # sends nothing, so the answer is not lost to a reset
        try:
            reply = _read_until_closed(extra)
        finally:
            extra.close()
        assert reply.startswith(b"HTTP/1.1 503 ")
        assert f"--max-connections {CAP}".encode() in reply
    finally:
        for sock in held:
            sock.close()
    _wait_for(lambda: _health(url) == 200)
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        assert client.post("/continue_generation", json={}).status_code == 200
        _wait_for(lambda: _queued(client) == 0)
        r = client.post("/generate", json=_gen_body(1))
        assert r.status_code == 200


def test_full_queue_answers_503_with_a_message(limited_engine: ServerProcess) -> None:
    url = limited_engine.url
    first, fits = CAP - 4, 4
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        assert client.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
        result: dict[str, httpx.Response] = {}

        def call() -> None:
            with httpx.Client(base_url=url, headers=AUTH, timeout=60) as other:
                result["r"] = other.post("/generate", json=_gen_body(first))

        worker = threading.Thread(target=call)
        worker.start()
        try:
            _wait_for(lambda: _queued(client) == first)
            full = client.post("/generate", json=_gen_body(fits + 1))
            assert full.status_code == 503
            message = full.json()["error"]["message"]
            assert "--max-queued-requests" in message and "retry later" in message
            too_big = client.post("/generate", json=_gen_body(CAP + 1))
            assert too_big.status_code == 400
            assert "split it" in too_big.json()["error"]["message"]
            stream_body = {**_gen_body(fits), "stream": True}
            with client.stream("POST", "/generate", json=stream_body) as streamed:
                assert streamed.status_code == 200  # exactly fills the queue
                assert _queued(client) == CAP
                assert client.post("/continue_generation", json={}).status_code == 200
                assert streamed.read().endswith(b"data: [DONE]\n\n")
        finally:
            assert client.post("/continue_generation", json={}).status_code == 200
            worker.join(60)
        assert result["r"].status_code == 200 and len(result["r"].json()) == first
        assert _queued(client) == 0
        assert client.post("/generate", json=_gen_body(CAP)).status_code == 200


# ---- fair admission (in-process) -------------------------------------------------------------


@pytest.fixture(scope="module")
def small_batch_engine(tiny_model: Path) -> Iterator[Engine]:
    eng = Engine(str(tiny_model), num_threads=1, max_running_requests=4, max_queued_requests=4096)
    yield eng
    eng.shutdown()


def _request(
    eng: Engine, tag: str, count: int, max_new: int, prompt: list[int], done: Callable
) -> list[Sequence]:
    params = parse_sampling_params({"max_new_tokens": max_new, "ignore_eos": True}, VOCAB)
    return [eng.make_sequence(prompt, params, rid=f"{tag}-{i}", on_done=done) for i in range(count)]


def test_short_request_is_not_stuck_behind_a_greedy_queue(small_batch_engine: Engine) -> None:
    eng = small_batch_engine
    finished: list[str] = []
    lock = threading.Lock()
    all_done = threading.Event()
    greedy_requests, per_request = 3, 4 * FAIR_QUANTUM
    total = greedy_requests * per_request + 1

    def done(s: Sequence) -> None:
        with lock:
            finished.append(s.rid)
            if len(finished) == total:
                all_done.set()

    eng.paused = True  # queue everything before the first admission
    try:
        for g in range(greedy_requests):
            eng.submit(_request(eng, f"greedy{g}", per_request, 3, [4, 5, 6, 7], done))
        eng.submit(_request(eng, "short", 1, 2, [8, 9], done))
        assert eng.num_queued() == total
    finally:
        eng.paused = False
        eng._wake.set()
    assert all_done.wait(120), f"only {len(finished)} of {total} finished"
    position = finished.index("short-0")
    # first come first served would finish every greedy sequence first (position total - 1);
    # fair admission lets each earlier request have one turn, plus one running batch
    assert position <= greedy_requests * FAIR_QUANTUM + eng.max_running
    assert position < total - 1
    # a request's sequences still start in order within its turns
    greedy0 = [r for r in finished if r.startswith("greedy0-")]
    assert sorted(greedy0[:FAIR_QUANTUM], key=lambda r: int(r.split("-")[1])) == [
        f"greedy0-{i}" for i in range(FAIR_QUANTUM)
    ]


def test_queue_bound_in_process(tiny_model: Path) -> None:
    eng = Engine(str(tiny_model), num_threads=1, max_queued_requests=5)
    try:
        eng.paused = True
        eng.submit(_request(eng, "a", 3, 2, [4, 5], lambda s: None))
        with pytest.raises(QueueFullError, match="retry later"):
            eng.submit(_request(eng, "b", 3, 2, [4, 5], lambda s: None))
        with pytest.raises(RequestError, match="split it"):
            eng.submit(_request(eng, "c", 6, 2, [4, 5], lambda s: None))
        assert eng.num_queued() == 3  # a rejected request leaves nothing behind
        # SGLang's counts are disjoint: waiting sequences are queued, not running
        assert (eng.num_running(), eng.num_in_flight()) == (0, 3)
        eng.submit(_request(eng, "b", 2, 2, [4, 5], lambda s: None))  # rids of b are free
        assert eng.num_queued() == 5
        assert eng.call(lambda: eng.abort("a-1")).result(10) == 1
        assert eng.num_queued() == 4
    finally:
        eng.shutdown()


# ---- weight-load errors ---------------------------------------------------------------------


def _bad_paths(root: Path) -> list[Path]:
    empty = root / "empty"
    empty.mkdir()
    other = root / "other-files"
    other.mkdir()
    (other / "model.bin").write_bytes(b"\0" * 64)
    garbage = root / "garbage.safetensors"
    garbage.write_bytes(os.urandom(256))
    huge_header = root / "huge-header"
    huge_header.mkdir()
    (huge_header / "model.safetensors").write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    nested = root / "nested"
    (nested / "dir.safetensors").mkdir(parents=True)
    return [root / "does" / "not" / "exist", empty, other, garbage, huge_header, nested]


def test_weight_load_errors_do_not_reveal_paths(tmp_path: Path) -> None:
    shapes = set()
    for path in _bad_paths(tmp_path):
        with pytest.raises(RequestError) as err:
            load_safetensors_dir(path)
        message = str(err.value)
        assert repr(str(path)) in message
        shapes.add(message.replace(repr(str(path)), "<path>"))
    assert len(shapes) == 1, shapes
    (shape,) = shapes
    for leak in ("exist", "header", "no *.safetensors", "directory not", "Permission"):
        assert leak not in shape


def test_weight_load_errors_over_http_share_one_shape(
    limited_engine: ServerProcess, tmp_path: Path
) -> None:
    shapes = set()
    with httpx.Client(base_url=limited_engine.url, headers=AUTH, timeout=60) as client:
        for path in _bad_paths(tmp_path):
            r = client.post("/update_weights_from_disk", json={"model_path": str(path)})
            assert r.status_code == 400 and r.json()["success"] is False
            shapes.add(r.json()["message"].replace(repr(str(path)), "<path>"))
    assert len(shapes) == 1, shapes


# ---- command line ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--max-queued-requests", "0"),
        ("--max-connections", "0"),
        ("--request-read-timeout", "0"),
        ("--timeout-keep-alive", "0"),
    ],
)
def test_cli_rejects_bad_limits(tiny_model: Path, flag: str, value: str) -> None:
    args = build_parser().parse_args(["--model-path", str(tiny_model), flag, value])
    with pytest.raises(SystemExit, match=flag):
        validate(args)


def test_connection_cap_fits_the_open_file_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    limits = {"soft": 512, "hard": 700}

    def getrlimit(which: int) -> tuple[int, int]:
        return limits["soft"], limits["hard"]

    def setrlimit(which: int, value: tuple[int, int]) -> None:
        if value[0] > limits["hard"]:
            raise ValueError("over the hard limit")
        limits["soft"] = value[0]

    monkeypatch.setattr(resource, "getrlimit", getrlimit)
    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    # raised as far as the hard limit allows, and the cap lowered to what then fits
    fitted = fit_connections_to_fd_limit(1024)
    assert limits["soft"] == 700
    assert 0 < fitted < 700 < 1024
    # a cap that fits once the soft limit is raised is kept
    limits.update(soft=512, hard=1 << 20)
    assert fit_connections_to_fd_limit(1024) == 1024
    assert limits["soft"] > 1024
