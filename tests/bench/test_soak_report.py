"""``vattn bench soak``'s verdicts and report, from synthetic samples."""

from vattn.bench import soak_report as rep
from vattn.bench.soak_client import Result


def _samples(n=40, fds=lambda i: 100, rss=lambda i: 2000.0, gpu=None):
    out = [{"t": float(i), "phase": "load", "fds": fds(i), "rss_mb": rss(i), "threads": 60,
            "gpu_mb": None if gpu is None else gpu(i), "pages_mapped": 10 + i, "pages_free": 90 - i,
            "ok": i, "aborted": 0, "errors": 0, "in_flight": 2} for i in range(n)]
    return out + [{"t": float(n), "phase": "final", "fds": 5000, "rss_mb": 9e9}]   # not judged


def _result(**kw):
    base = {"mode": "vattn", "counts": {"sent": 40, "ok": 38, "aborted": 2, "errors": 0},
            "server_alive": True, "load_s": 40.0, "tokens": {"input": 100, "output": 50},
            "final_snapshot": {"idle": True, "audit": "ok", "requests_holding_slots": 1},
            "latency": rep.latency([Result(0, "ok", 0.0, 1.0, 5, 3, ttft_s=0.1)])}
    return base | kw


def _failed(checks):
    return {name for name, ok, _ in checks if not ok}


def test_a_clean_soak_passes_every_check():
    checks = rep.verdicts(_result(), _samples(gpu=lambda i: 30000.0))
    assert _failed(checks) == set() and len(checks) == 7


def test_spikes_are_not_growth():
    """RSS jumping by 100 MB between samples but not rising (a real CPU soak's series) is flat."""
    spiky = _samples(rss=lambda i: 2500.0 + (100.0 if i % 7 == 0 else 0.0) - (i > 30) * 60)
    assert _failed(rep.verdicts(_result(), spiky)) == set()
    g = rep.growth(spiky, "rss_mb")
    assert g["q2"] == 2500.0 and g["q4"] == 2440.0 and g["max"] == 2600.0 and g["growth"] == -60.0


def test_sockets_of_requests_in_flight_are_not_an_fd_leak():
    """A server that slows near the end holds more requests open: its fds rise with them (one
    socket each), which is flat net of them; fds that rise while in flight stays put are not."""
    rising = [s | {"in_flight": 2 + s["t"] // 2} if s["phase"] == "load" else s
              for s in _samples(fds=lambda i: 100 + i // 2)]
    assert _failed(rep.verdicts(_result(), rising)) == set()
    assert _failed(rep.verdicts(_result(), _samples(fds=lambda i: 100 + i // 2))) == {"open fds flat"}


def test_each_kind_of_trouble_fails_its_check():
    assert _failed(rep.verdicts(_result(), _samples(fds=lambda i: 100 + i))) == {"open fds flat"}
    assert _failed(rep.verdicts(_result(), _samples(rss=lambda i: 2000.0 + 5 * i))) == {"host RSS flat"}
    assert _failed(rep.verdicts(_result(), _samples(gpu=lambda i: 30000.0 + 10 * i))) == {"GPU memory flat"}
    bad = _result(counts={"sent": 40, "ok": 37, "aborted": 2, "errors": 1}, first_errors=["request 3: HTTP 500"],
                  server_alive=False)
    checks = rep.verdicts(bad, _samples())
    assert _failed(checks) == {"no request failed", "server up to the end"}
    assert "HTTP 500" in dict((n, d) for n, _, d in checks)["no request failed"]
    leak = _result(final_snapshot={"idle": True, "audit": "VattnError: page 3 ...", "requests_holding_slots": 7})
    assert _failed(rep.verdicts(leak, _samples())) == {"vattn audit when idle", "no slot held after the load"}
    assert "vattn audit when idle" in _failed(rep.verdicts(_result(final_snapshot=None), _samples()))
    drill = {"idle": True, "audit": "ok", "requests_holding_slots": 0, "requests_failed": 2}
    bad2 = _result(counts={"sent": 40, "ok": 36, "aborted": 2, "errors": 2}, final_snapshot=drill)
    checks = rep.verdicts(bad2, _samples())
    assert _failed(checks) == set() and "errors are the requests vattn failed" in {n for n, _, _ in checks}
    bad2["counts"] = {"sent": 40, "ok": 35, "aborted": 2, "errors": 3}      # one error vattn did not decide
    assert _failed(rep.verdicts(bad2, _samples())) == {"errors are the requests vattn failed"}
    stock = rep.verdicts(_result(mode="stock", final_snapshot=None), _samples())
    assert _failed(stock) == set() and not any("vattn" in n for n, _, _ in stock)


def test_on_the_host_backend_rss_is_judged_net_of_the_kv_pages():
    grows = _samples(rss=lambda i: 2000.0 + 5 * i)                  # +100 MB over the run
    for i, s in enumerate(grows[:-1]):
        s["mapped_bytes"] = 5 * i * 2**20                           # all of it vattn's pages
    assert "host RSS flat" in _failed(rep.verdicts(_result(device="cuda"), grows))
    assert _failed(rep.verdicts(_result(device="cpu"), grows)) == set()
    leak = _samples(rss=lambda i: 2000.0 + 5 * i)
    for s in leak[:-1]:
        s["mapped_bytes"] = 0
    assert "host RSS flat" in _failed(rep.verdicts(_result(device="cpu"), leak))


def test_a_dead_engine_is_not_judged_flat():
    """The GPU soak of 2026-12-06: the engine core died 20 s in, its processes' zeros read as
    flat series; now each series check fails, saying why."""
    dead = _samples(fds=lambda i: 0 if i > 5 else 100, rss=lambda i: 0.0 if i > 5 else 2000.0,
                    gpu=lambda i: 4.0 if i > 5 else 30000.0)
    checks = rep.verdicts(_result(server_alive=False, died_at_s=6.0), dead)
    assert _failed(checks) == {"server up to the end", "open fds flat", "host RSS flat", "GPU memory flat"}
    detail = dict((n, d) for n, _, d in checks)
    assert "exited 6 s into the load" in detail["server up to the end"]
    assert detail["GPU memory flat"] == "not judged: the engine died 6 s into the load"


def test_markdown_and_plot(tmp_path):
    samples = _samples(fds=lambda i: 100 + i)
    text = rep.markdown(_result(), samples, title="t", command="vattn bench soak ...")
    assert "| open fds flat | **FAIL** |" in text and "| vattn pages mapped | 10 | 24.5 | 44.5 | 49 | 49 |" in text
    assert "| 40 | 38 | 2 | 0 | 40 s | 0.95 |" in text
    png = rep.plot(samples, str(tmp_path / "s.png"), title="t")
    assert png is None or (tmp_path / "s.png").stat().st_size > 1000


def test_percentile():
    assert rep.percentile([], 0.5) is None and rep.percentile([3, 1, 2], 0.5) == 2
    assert rep.percentile(list(range(101)), 0.99) == 99


def test_engine_prefix_cache_reads_the_engines_own_counters():
    import http.server
    import threading
    from vattn.bench.soak import engine_prefix_cache
    pages = {"/metrics": ""}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = pages.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write((body or "").encode())

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        pages["/metrics"] = ('# HELP x\nvllm:prefix_cache_queries_total{engine="0",model_name="m"} 600.0\n'
                             'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 256.0\n'
                             'vllm:prefix_cache_hits_created{engine="0"} 1.7e9\n')
        assert engine_prefix_cache(url) == {"queries": 600.0, "hits": 256.0, "hit_rate": 256 / 600}
        pages["/metrics"] = 'sglang:cache_hit_rate{model_name="m"} 0.25\n'
        assert engine_prefix_cache(url) == {"hit_rate": 0.25}
        pages["/metrics"] = "other_metric 3\n"
        assert engine_prefix_cache(url) is None
        del pages["/metrics"]
        assert engine_prefix_cache(url) is None                 # 404: no metrics exported
    finally:
        srv.shutdown()


def test_process_group_usage_counts_this_group():
    import os
    from vattn.bench.soak import process_group_usage
    u = process_group_usage(os.getpgid(0))
    assert u["procs"] >= 1 and u["rss_mb"] > 10 and u["fds"] >= 3 and u["threads"] >= 1
    assert any(k.endswith(f":{os.getpid()}") for k in u["rss_by_proc"])
    assert abs(sum(u["rss_by_proc"].values()) - u["rss_mb"]) < 1
    assert process_group_usage(2 ** 22 + 12345) == {"rss_mb": 0.0, "fds": 0, "threads": 0, "procs": 0,
                                                    "rss_by_proc": {}}


def test_the_report_names_vattns_counters():
    res = _result(final_snapshot={"idle": True, "audit": "ok", "requests_holding_slots": 0,
                                  "driver_faults": 12, "driver_retries": 12, "map_calls": 900, "unmap_calls": 0})
    text = rep.markdown(res, _samples(), title="t", command="c")
    assert "vattn's counters over the run: map_calls 900, driver_faults 12, driver_retries 12" in text
