"""`bentoml build` makes a real Bento of the service, and the built Bento serves."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import yaml

from service.processes import ManagedProcess, free_port

ROOT = Path(__file__).resolve().parent.parent
BENTOML = str(Path(sys.executable).parent / "bentoml")


def _requirement_names(reqs: list[str]) -> dict[str, str]:
    return {re.split(r"[\[<>=!~ ]", r, maxsplit=1)[0].lower(): r for r in reqs}


def test_bentofile_requirements_match_the_project() -> None:
    bentofile = yaml.safe_load((ROOT / "bentofile.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert _requirement_names(bentofile["python"]["packages"]) == _requirement_names(
        project["dependencies"])
    assert bentofile["service"] == "service.service:Obliviate"
    assert bentofile["python"]["lock_packages"] is False  # building must not need a network


def test_the_built_bento_serves_a_guarded_prediction(tmp_path: Path) -> None:
    env = {"BENTOML_HOME": str(tmp_path / "bentoml"), "BENTOML_DO_NOT_TRACK": "true",
           "OBLIVIATE_DATABASE_URL": f"sqlite:///{tmp_path / 'ledger.db'}",
           "OBLIVIATE_HMAC_KEY_FILE": str(tmp_path / "hmac.key"),
           "OBLIVIATE_ADMIN_TOKEN": "t" * 32,
           "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom")}
    (tmp_path / "prom").mkdir()
    full_env = {**os.environ, **env}

    def run(*args: str) -> str:
        out = subprocess.run(args, env=full_env, cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        return out.stdout

    obliviate = (sys.executable, "-m", "service.cli")
    run(*obliviate, "ledger", "init", "--dataset", "breast_cancer")
    run(*obliviate, "model", "train", "--learner", "sisa",
        "--params", '{"n_shards": 3, "epochs_per_slice": 5}')
    run(BENTOML, "build", "--output", "tag")
    bentos = tmp_path / "bentoml" / "bentos" / "obliviate"
    [tag] = [p.name for p in bentos.iterdir() if p.name != "latest"]
    bento = bentos / tag
    # the Bento holds the code and the requirements, and names the current version
    info = yaml.safe_load((bento / "bento.yaml").read_text())
    assert [m["tag"] for m in info["models"]] == ["obliviate:v000001"]
    assert (bento / "src" / "service" / "service.py").exists()
    assert (bento / "src" / "service" / "audit" / "index.html").exists()
    # ... and carries it: exported, then imported into a fresh home with no models
    run(BENTOML, "export", f"obliviate:{tag}", str(tmp_path / "obliviate.bento"))
    env["BENTOML_HOME"] = full_env["BENTOML_HOME"] = str(tmp_path / "elsewhere")
    run(BENTOML, "import", str(tmp_path / "obliviate.bento"))
    assert (tmp_path / "elsewhere" / "models" / "obliviate" / "v000001" / "manifest.json"
            ).exists()

    port = free_port()
    server = ManagedProcess(["serve", f"obliviate:{tag}", "--port", str(port)], env,
                            tmp_path / "bento-serve.log", program=(BENTOML,), cwd=tmp_path)
    try:
        server.wait_http(f"http://127.0.0.1:{port}/readyz", timeout_s=120)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/predict",
                       json={"instances": [[0.5] * 30, [0.1] * 30]}, timeout=30)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model_version"] == "v000001" and body["guard"] == "sound"
        assert set(body) == {"labels", "model_version", "guard"}  # labels only, no scores
        assert all(label in (0, 1) for label in body["labels"])
    finally:
        assert server.stop() == 0, server.log_tail()
