"""The servers bench/serving.py measures, each started as its user would start it, and the
vLLM client run from vLLM's own environment.

Every start waits for the OpenAI endpoint with a deadline; every stop takes the whole
process group down, so a failed run leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from step_histograms import step_summary

ROOT = Path(__file__).resolve().parent.parent


def router_placements(url: str) -> dict[str, float]:
    """Baton's router at `url`: how many prompts it prefilled locally and remotely (empty
    for another server)."""
    try:
        text = httpx.get(url + "/metrics", timeout=5.0).text
    except httpx.HTTPError:
        return {}
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "baton_router_routes_total":
                path = sample.labels.get("path", "")
                found[path] = found.get(path, 0.0) + sample.value
    return found


def router_decisions(url: str) -> dict:
    """Baton's router at `url`: its placement decisions and what each was made of
    (`/router/placements`), times relative to the first; empty for another server."""
    try:
        answer = httpx.get(url + "/router/placements", timeout=5.0).json()
    except (httpx.HTTPError, ValueError):
        return {}
    placements = answer.get("placements", [])
    start = placements[0]["at"] if placements else 0.0
    for p in placements:
        p["at"] = round(p["at"] - start, 3)
        p.pop("request_id", None)
    return {"summary": answer.get("summary", {}), "placements": placements}


def worker_steps(url: str) -> dict[str, dict]:
    """Baton's workers behind the router at `url`: each one's engine steps by kind
    (step_histograms.step_summary), keyed by role and address; empty elsewhere."""
    try:
        workers = httpx.get(url + "/router/state", timeout=5.0).json()["workers"]
        return {f"{w['role']}@{w['url']}": step_summary(httpx.get(w["url"] + "/metrics", timeout=5.0).text)
                for w in workers}
    except (httpx.HTTPError, KeyError, ValueError):
        return {}


class Server:
    def __init__(self, name: str, command: list[str], port: int, log: Path, env: dict | None = None):
        self.name, self.port, self.log = name, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(command, stdout=open(log, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
                                     env={**os.environ, **(env or {})}, start_new_session=True, cwd=ROOT)

    def wait_ready(self, timeout_s: float) -> str:
        """The served model's id, once /v1/models answers."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log}")
            try:
                answer = httpx.get(self.url + "/v1/models", timeout=2.0)
                if answer.status_code == 200:
                    return answer.json()["data"][0]["id"]
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.name} did not serve within {timeout_s:.0f}s; see {self.log}")

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers of the group


def baton_up(layout: list[str], port: int, log_dir: Path, worker_args: list[str]) -> Server:
    log_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "baton.cli", "up", *layout, "--port", str(port),
               "--log-dir", str(log_dir), *(f"--worker-arg={a}" for a in worker_args)]
    return Server("baton up " + " ".join(layout), command, port, log_dir / "up.out")


def vllm_serve(venv: Path, model_dir: Path, served_name: str, dtype: str, port: int, log: Path,
               threads: int) -> Server:
    # the API server module, not `vllm serve`: the CLI looks itself up as the dist `vllm`
    command = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(model_dir), "--served-model-name", served_name,
               "--dtype", dtype, "--port", str(port), "--host", "127.0.0.1", "--max-model-len", "2048"]
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
           "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    return Server(f"vllm serve ({dtype})", command, port, log, env)


@contextlib.contextmanager
def vllm_dist_alias(venv: Path):
    """`vllm bench` looks itself up as the dist `vllm`, which vllm-cpu does not install; the
    alias exists only while the client runs (vLLM's platform detection fails beside it, so it
    must not exist when a server starts)."""
    real, alias = remove_dist_alias(venv)
    shutil.copytree(real, alias)
    meta = alias / "METADATA"
    meta.write_text("".join(("Name: vllm\n" if line.startswith("Name:") else line)
                            for line in meta.read_text().splitlines(keepends=True)))
    try:
        yield
    finally:
        shutil.rmtree(alias, ignore_errors=True)


def remove_dist_alias(venv: Path) -> tuple[Path, Path]:
    """Remove the alias `vllm_dist_alias` makes, if a run killed mid-way left it (a vLLM
    server cannot start beside it); return (vllm-cpu's own dist-info, the alias's path)."""
    site = next((venv / "lib").glob("python3*/site-packages"))
    real = next(site.glob("vllm_cpu-*.dist-info"))
    alias = site / real.name.replace("vllm_cpu-", "vllm-")
    shutil.rmtree(alias, ignore_errors=True)
    return real, alias


def vllm_bench_serve(venv: Path, url: str, model: str, tokenizer: Path, load: dict, out: Path,
                     timeout_s: float) -> dict:
    """One `vllm bench serve` run; its saved result JSON (with each request's TTFT and gaps
    between tokens, for reading where a percentile comes from)."""
    import json

    out.parent.mkdir(parents=True, exist_ok=True)
    command = [str(venv / "bin" / "vllm"), "bench", "serve", "--backend", "openai", "--base-url", url,
               "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(tokenizer),
               "--dataset-name", "random", "--random-input-len", str(load["input_len"]),
               "--random-output-len", str(load["output_len"]), "--num-prompts", str(load["num_prompts"]),
               "--max-concurrency", str(load["max_concurrency"]), "--ignore-eos", "--seed", str(load["seed"]),
               "--num-warmups", str(load["warmups"]), "--percentile-metrics", "ttft,tpot,itl,e2el",
               "--metric-percentiles", "25,50,75,90,99", "--save-result", "--result-dir", str(out.parent),
               "--result-filename", out.name, "--save-detailed", "--disable-tqdm"]
    # the platform named, as the alias hides vllm-cpu's own name: detection left undecided
    # loads vllm._C, built for AVX-512, and dies of SIGILL on a CPU without it (the CPU
    # platform loads the _C_AVX2 build there)
    with vllm_dist_alias(venv):
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"})
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return json.loads(out.read_text())
