"""Training runs and their checkpoints through the official SDK's RestClient and CLI (`tinker` 0.38.0).

The controller runs on loopback (port 0); a small test-side driver takes the client commands
and writes each save as a directory of known bytes, so listings, sizes, deletions and
downloads can be checked file by file. Hostile inputs (bad ids, traversal, unknown
checkpoints, wrong token or signature) are refused with a 4xx naming the problem and change
nothing.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, urlsplit

import httpx
import pytest
import tinker
from click.testing import CliRunner
from tinker import types
from tinker.cli.__main__ import main_cli

from miles.controller.tinker.gateway import GatewayConfig
from miles.utils.adapter_config import AdapterDefaults
from miles.utils.types import (
    ClientCommand,
    LoadStateCommand,
    SaveForSamplerCommand,
    SaveStateCommand,
    WeightsResult,
)
from tests.helpers.controller_fakes import ThreadedController, controller_config

TOKEN = "tml-checkpoint-test-token"
BASE = "tiny-base"


@pytest.fixture(autouse=True)
def no_sdk_telemetry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_TELEMETRY", "0")


def start_plane(data_root: Path, defaults: AdapterDefaults, registry: Path | None = None) -> ThreadedController:
    config = controller_config(data_root, defaults, n_slots=3, token=TOKEN, registry_path=registry,
                               gateway=GatewayConfig(base_model=BASE, retrieve_poll_s=1.0))
    return ThreadedController(config)


def files_of(command: SaveStateCommand | SaveForSamplerCommand) -> dict[str, bytes]:
    """What the driver writes for a save: PEFT files named after the checkpoint (and its optimizer)."""
    peft = {"adapter_config.json": b'{"r": 4, "peft_type": "LORA"}',
            "adapter_model.safetensors": f"weights of {command.tinker_path}".encode() * 3}
    if isinstance(command, SaveStateCommand):
        peft["optimizer/state.pt"] = b"adam moments " * 5
    return peft


class FileDriver:
    """Takes client commands in a thread; writes saves' files, checks loads read a directory."""

    def __init__(self, plane: ThreadedController) -> None:
        self.plane = plane
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        controller = self.plane.controller
        while not self._stop.is_set():
            for command in self.plane.call(controller.take_client_commands()).commands:
                self._run(command)
            self.plane.call(controller.wait_for_client_commands(0.2))

    def _run(self, command: ClientCommand) -> None:
        request, controller = command.request, self.plane.controller
        if isinstance(request, SaveStateCommand | SaveForSamplerCommand):
            for name, data in files_of(request).items():
                (Path(request.directory) / name).parent.mkdir(parents=True, exist_ok=True)
                (Path(request.directory) / name).write_bytes(data)
        if isinstance(request, LoadStateCommand) and not Path(request.directory).is_dir():
            self.plane.call(controller.fail_client_command(command.future_id, f"no {request.directory}"))
            return
        self.plane.call(controller.complete_client_command(command.future_id, WeightsResult()))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@pytest.fixture
def plane(data_root: Path, defaults: AdapterDefaults, tmp_path: Path) -> Iterator[ThreadedController]:
    controller = start_plane(data_root, defaults, tmp_path / "controller" / "registry.sqlite")
    driver = FileDriver(controller)
    yield controller
    driver.close()
    controller.close()


@pytest.fixture
def raw(plane: ThreadedController) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=plane.url, headers={"X-API-Key": TOKEN}, trust_env=False, timeout=30) as http:
        yield http


def size(command_files: dict[str, bytes]) -> int:
    return sum(len(b) for b in command_files.values())


def test_training_runs_and_checkpoints_are_listed_and_survive_a_restart(
        data_root: Path, defaults: AdapterDefaults, tmp_path: Path) -> None:
    registry = tmp_path / "controller" / "registry.sqlite"
    plane = start_plane(data_root, defaults, registry)
    driver = FileDriver(plane)
    try:
        rest = tinker.RestClient(base_url=plane.url, api_key=TOKEN)
        with tinker.ServiceClient(base_url=plane.url, api_key=TOKEN) as service:
            first = service.create_lora_training_client(BASE, rank=4, train_unembed=False,
                                                        user_metadata={"owner": "ana"}).result(timeout=30)
            second = service.create_lora_training_client(BASE, rank=2, train_unembed=False,
                                                         train_mlp=False).result(timeout=30)
            early = first.save_state("early").result(timeout=30).path
            late = first.save_state("late").result(timeout=30).path
            snapshot = first.save_weights_for_sampler("snap").result(timeout=30).path
            assert (early, snapshot) == (f"tinker://{first.model_id}/weights/early",
                                         f"tinker://{first.model_id}/sampler_weights/snap")

            run = rest.get_training_run(first.model_id).result(timeout=30)
            assert (run.training_run_id, run.base_model, run.is_lora, run.lora_rank, run.corrupted,
                    run.user_metadata) == (first.model_id, BASE, True, 4, False, {"owner": "ana"})
            assert run.model_owner == service.holder.get_session_id()
            assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == late
            assert run.last_sampler_checkpoint is not None and run.last_sampler_checkpoint.tinker_path == snapshot
            assert rest.get_training_run_by_tinker_path(snapshot).result(timeout=30) == run

            runs = rest.list_training_runs(limit=1).result(timeout=30)
            assert [r.training_run_id for r in runs.training_runs] == [second.model_id]  # newest first
            assert (runs.cursor.offset, runs.cursor.limit, runs.cursor.total_count) == (0, 1, 2)
            page2 = rest.list_training_runs(limit=1, offset=1).result(timeout=30)
            assert [r.training_run_id for r in page2.training_runs] == [first.model_id]
            assert rest.get_training_run(second.model_id).result(timeout=30).last_checkpoint is None

            listed = rest.list_checkpoints(first.model_id).result(timeout=30).checkpoints
            assert [(c.checkpoint_id, c.checkpoint_type, c.tinker_path) for c in listed] == [
                ("sampler_weights/snap", "sampler", snapshot), ("weights/late", "training", late),
                ("weights/early", "training", early)]
            assert [c.size_bytes for c in listed] == [
                size(files_of(SaveForSamplerCommand(name="snap", tinker_path=snapshot, directory=""))),
                size(files_of(SaveStateCommand(name="late", tinker_path=late, directory=""))),
                size(files_of(SaveStateCommand(name="early", tinker_path=early, directory="")))]
            assert all(c.public is False and c.expires_at is None for c in listed)
            assert listed[0].time >= listed[1].time >= listed[2].time
            assert rest.list_checkpoints(second.model_id).result(timeout=30).checkpoints == []
            user = rest.list_user_checkpoints(limit=2, offset=1).result(timeout=30)
            assert [c.tinker_path for c in user.checkpoints] == [late, early]
            assert user.cursor is not None and user.cursor.total_count == 3

            info = rest.get_weights_info_by_tinker_path(late).result(timeout=30)
            assert (info.base_model, info.is_lora, info.lora_rank, info.train_unembed, info.train_mlp,
                    info.train_attn) == (BASE, True, 4, False, True, True)
            only = second.save_state("only").result(timeout=30).path  # a layout that trains attention only
            info = rest.get_weights_info_by_tinker_path(only).result(timeout=30)
            assert (info.lora_rank, info.train_unembed, info.train_mlp, info.train_attn) == (2, False, False, True)
    finally:
        driver.close()
        plane.close()

    again = start_plane(data_root, defaults, registry)
    try:
        rest = tinker.RestClient(base_url=again.url, api_key=TOKEN)
        assert [c.tinker_path for c in rest.list_checkpoints(first.model_id).result(timeout=30).checkpoints] == [
            snapshot, late, early]
        assert rest.get_training_run(first.model_id).result(timeout=30).last_checkpoint == run.last_checkpoint
        assert rest.list_training_runs().result(timeout=30).cursor.total_count == 2
        rest.delete_checkpoint_from_tinker_path(early).result(timeout=30)  # its model was unloaded: no resume point
        assert [c.tinker_path for c in rest.list_user_checkpoints().result(timeout=30).checkpoints] == [
            only, snapshot, late]
        info = rest.get_weights_info_by_tinker_path(only).result(timeout=30)  # the layout is the model's, kept
        assert (info.train_unembed, info.train_mlp, info.train_attn) == (False, False, True)
    finally:
        again.close()


def test_deletion_keeps_what_a_model_resumes_from_or_a_sampler_samples(plane: ThreadedController,
                                                                        raw: httpx.Client) -> None:
    rest = tinker.RestClient(base_url=plane.url, api_key=TOKEN)
    with tinker.ServiceClient(base_url=plane.url, api_key=TOKEN) as service:
        trainer = service.create_lora_training_client(BASE, rank=4, train_unembed=False).result(timeout=30)
        old = trainer.save_state("old").result(timeout=30).path
        resume = trainer.save_state("resume").result(timeout=30).path
        snap = trainer.save_weights_for_sampler("snap").result(timeout=30).path
        directory = Path(plane.call(plane.controller.snapshot()).clients[
            trainer.model_id.replace(":", ".")].resume_from or "")
        assert directory.name == "resume" and directory.is_dir()

        refused = raw.delete(f"/api/v1/training_runs/{trainer.model_id}/checkpoints/weights/resume")
        assert (refused.status_code, refused.headers["x-should-retry"]) == (400, "false")
        assert f"resume point of live model {trainer.model_id}" in refused.json()["detail"]
        with pytest.raises(tinker.BadRequestError, match="resume point"):
            rest.delete_checkpoint_from_tinker_path(resume).result(timeout=30)
        assert directory.is_dir()

        sampler = service.create_sampling_client(model_path=snap).result(timeout=30)
        in_use = raw.delete(f"/api/v1/training_runs/{trainer.model_id}/checkpoints/sampler_weights/snap")
        assert in_use.status_code == 400 and "sampling session" in in_use.json()["detail"]
        assert sampler is not None

        rest.delete_checkpoint(trainer.model_id, "weights/old").result(timeout=30)
        assert not (directory.parent / "old").exists()
        assert [c.tinker_path for c in rest.list_checkpoints(trainer.model_id).result(timeout=30).checkpoints] == [
            snap, resume]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # load_state is deprecated in the SDK, still served
            with pytest.raises(tinker.RequestFailedError, match="never saved one by that name"):
                trainer.load_state(old).result(timeout=30)
        gone = raw.delete(f"/api/v1/training_runs/{trainer.model_id}/checkpoints/weights/old")
        assert gone.status_code == 404 and f"No checkpoint 'tinker://{trainer.model_id}/weights/old'" in gone.text
        assert trainer.save_state("old").result(timeout=30).path == old  # the name is free again

    # The session finished: its model is unloaded and its sampling session closed.
    rest.delete_checkpoint_from_tinker_path(resume).result(timeout=30)
    rest.delete_checkpoint_from_tinker_path(snap).result(timeout=30)
    assert not directory.exists() and not (directory.parent.parent / "sampler_weights" / "snap").exists()
    with tinker.ServiceClient(base_url=plane.url, api_key=TOKEN) as service:
        with pytest.raises(tinker.NotFoundError, match=f"No sampler weights '{snap}': they were deleted"):
            service.create_sampling_client(model_path=snap).result(timeout=30)


def test_tinker_checkpoint_download_gets_the_adapter_files(plane: ThreadedController, raw: httpx.Client,
                                                           tmp_path: Path) -> None:
    rest = tinker.RestClient(base_url=plane.url, api_key=TOKEN)
    with tinker.ServiceClient(base_url=plane.url, api_key=TOKEN) as service:
        trainer = service.create_lora_training_client(BASE, rank=4, train_unembed=False).result(timeout=30)
        saved = trainer.save_state("final").result(timeout=30).path
        sessions_before = set(rest.list_sessions().result(timeout=30).sessions)

        out = tmp_path / "downloads"
        result = CliRunner().invoke(main_cli, ["--format", "json", "checkpoint", "download", saved,
                                               "--output", str(out)],
                                    env={"TINKER_BASE_URL": plane.url, "TINKER_API_KEY": TOKEN})
        assert result.exit_code == 0, result.output
        target = out / saved.replace("tinker://", "").replace("/", "_")
        # The CLI loads the checkpoint into a new model and exports that model's LoRA.
        (cli_session,) = set(rest.list_sessions().result(timeout=30).sessions) - sessions_before
        (export_model,) = rest.get_session(cli_session).result(timeout=30).training_run_ids
        export = f"tinker://{export_model}/external_weights/download"
        expected = files_of(SaveForSamplerCommand(name="download", tinker_path=export, directory=""))
        assert {str(p.relative_to(target)): p.read_bytes() for p in target.rglob("*") if p.is_file()} == expected
        # Its temporary export is deleted, its model unloaded; the user's checkpoint stays.
        assert rest.list_checkpoints(export_model).result(timeout=30).checkpoints == []
        assert [c.tinker_path for c in rest.list_checkpoints(trainer.model_id).result(timeout=30).checkpoints] == [
            saved]
        assert raw.post("/api/v1/session_heartbeat", json={"session_id": cli_session}).status_code == 410

        # The same export by the SDK's calls, kept this time: its URLs work without the API key.
        exported = trainer.save_weights_external("mine", ttl_seconds=7200).result(timeout=30)
        urls = rest.get_external_weights_urls(exported.path).result(timeout=30)
        assert sorted(urls.urls) == ["adapter_config.json", "adapter_model.safetensors"]
        mine = files_of(SaveForSamplerCommand(name="mine", tinker_path=exported.path, directory=""))
        with httpx.Client(trust_env=False, timeout=30) as anonymous:
            for name, url in urls.urls.items():
                assert anonymous.get(url).content == mine[name]
        (listed,) = [c for c in rest.list_checkpoints(trainer.model_id).result(timeout=30).checkpoints
                     if c.checkpoint_type == "external"]
        assert listed.expires_at is not None and 7100 < (listed.expires_at - listed.time).total_seconds() <= 7200
        rest.set_checkpoint_ttl_from_tinker_path(exported.path, None).result(timeout=30)
        assert [c.expires_at for c in rest.list_checkpoints(trainer.model_id).result(timeout=30).checkpoints
                if c.checkpoint_type == "external"] == [None]


def test_export_ttls_expire_and_are_checked(plane: ThreadedController, raw: httpx.Client) -> None:
    rest = tinker.RestClient(base_url=plane.url, api_key=TOKEN)
    with tinker.ServiceClient(base_url=plane.url, api_key=TOKEN) as service:
        trainer = service.create_lora_training_client(BASE, rank=4, train_unembed=False).result(timeout=30)
        exported = trainer.save_weights_external("soon", ttl_seconds=3600).result(timeout=30).path
        saved = trainer.save_state("kept").result(timeout=30).path
        base = f"/api/v1/training_runs/{trainer.model_id}/checkpoints"
        short = raw.put(f"{base}/external_weights/soon/ttl", json={"ttl_seconds": 60})
        assert short.status_code == 400 and "between 3600 (1 hour)" in short.json()["detail"]
        training = raw.put(f"{base}/weights/kept/ttl", json={"ttl_seconds": 7200})
        assert training.status_code == 400 and "external_weights exports only" in training.json()["detail"]
        with pytest.raises(tinker.RequestFailedError, match="age_encryption_recipients is not served"):
            trainer.save_weights_external("sealed", age_encryption_recipients=["age1xyz"]).result(timeout=30)

        checkpoints = plane.controller.gateway.checkpoints
        now = checkpoints.clock()
        checkpoints.clock = lambda: now + 3601  # the export's hour has passed
        assert [c.tinker_path for c in rest.list_checkpoints(trainer.model_id).result(timeout=30).checkpoints] == [
            saved]
        directory = Path(plane.call(plane.controller.snapshot()).clients[
            trainer.model_id.replace(":", ".")].config.save) / "external_weights" / "soon"
        assert not directory.exists()
        with pytest.raises(tinker.NotFoundError, match="No checkpoint"):
            rest.get_external_weights_urls(exported).result(timeout=30)


def test_hostile_requests_are_refused_by_name_and_change_nothing(plane: ThreadedController,
                                                                  raw: httpx.Client) -> None:
    rest = tinker.RestClient(base_url=plane.url, api_key=TOKEN)
    with tinker.ServiceClient(base_url=plane.url, api_key=TOKEN) as service:
        mine = service.create_lora_training_client(BASE, rank=4, train_unembed=False).result(timeout=30)
        other = service.create_lora_training_client(BASE, rank=4, train_unembed=False).result(timeout=30)
        saved = mine.save_state("ckpt").result(timeout=30).path
        export = mine.save_weights_external("out").result(timeout=30).path
        other.save_state("theirs").result(timeout=30)
        before = {m: rest.list_checkpoints(m).result(timeout=30).checkpoints for m in (mine.model_id, other.model_id)}
        save_dir = Path(plane.call(plane.controller.snapshot()).clients[mine.model_id.replace(":", ".")].config.save)

        with httpx.Client(base_url=plane.url, headers={"X-API-Key": "wrong"}, trust_env=False) as wrong:
            for response in (wrong.get("/api/v1/training_runs"), wrong.get("/api/v1/checkpoints"),
                             wrong.delete(f"/api/v1/training_runs/{mine.model_id}/checkpoints/weights/ckpt")):
                assert response.status_code == 401
        with pytest.raises(tinker.AuthenticationError):
            tinker.RestClient(base_url=plane.url, api_key="tml-wrong").list_training_runs().result(timeout=30)

        base = f"/api/v1/training_runs/{mine.model_id}/checkpoints"
        for checkpoint_id, status, message in (
                ("weights/%2E%2E", 400, "checkpoint name '..'"),
                ("weights/..%2F..%2Fsave", 400, "checkpoint name '../../save'"),
                ("weights/%2Fetc%2Fpasswd", 400, "checkpoint name '/etc/passwd'"),
                ("weights", 400, "checkpoint name ''"),
                ("models/ckpt", 400, "'models' is not a checkpoint kind"),
                ("weights/theirs", 404, f"No checkpoint 'tinker://{mine.model_id}/weights/theirs'"),
                ("weights/nope", 404, "has no such checkpoint")):
            response = raw.delete(f"{base}/{checkpoint_id}")
            assert (response.status_code, response.headers["x-should-retry"]) == (status, "false"), checkpoint_id
            assert message in response.json()["detail"]
        unknown = raw.get("/api/v1/training_runs/s-nobody:train:0")
        assert unknown.status_code == 404 and "Unknown model 's-nobody:train:0'" in unknown.json()["detail"]
        with pytest.raises(tinker.NotFoundError, match="Unknown model 's-nobody:train:0'"):
            rest.list_checkpoints("s-nobody:train:0").result(timeout=30)
        for path, status in (("tinker://../weights/x", 400), ("/etc/passwd", 400),
                             (f"tinker://{mine.model_id}/weights/nope", 404)):
            assert raw.post("/api/v1/weights_info", json={"tinker_path": path}).status_code == status, path

        # Not served: a 4xx naming it, never a 5xx the SDK would retry.
        for response in (raw.post(f"{base}/weights/ckpt/publish"), raw.delete(f"{base}/weights/ckpt/publish")):
            assert response.status_code == 400 and "publishing checkpoints is not served" in response.text
        with pytest.raises(tinker.BadRequestError, match="copy_weights is not served"):
            rest.copy_weights(saved, "copy").result(timeout=30)
        assert raw.get("/api/v1/training_runs", params={"project_id": "p"}).status_code == 400

        # Signed download URLs: the signature names one file of one checkpoint until it expires.
        (url,) = [u for n, u in rest.get_external_weights_urls(export).result(timeout=30).urls.items()
                  if n == "adapter_config.json"]
        parts = urlsplit(url)
        with httpx.Client(base_url=plane.url, trust_env=False) as anonymous:
            assert anonymous.get(f"{parts.path}?{parts.query}").status_code == 200
            forged = anonymous.get(f"{parts.path.replace('adapter_config.json', 'adapter_model.safetensors')}"
                                   f"?{parts.query}")
            assert forged.status_code == 401 and "invalid download signature" in forged.json()["detail"]
            other_model = anonymous.get(f"{parts.path.replace(quote(mine.model_id), quote(other.model_id))}"
                                        f"?{parts.query}")
            assert other_model.status_code == 401
            later = parts.query.replace("expires=", "expires=9")
            assert anonymous.get(f"{parts.path}?{later}").status_code == 401
            unsigned = anonymous.get(parts.path, headers={"X-API-Key": TOKEN})  # the token is no signature
            assert unsigned.status_code == 401 and "needs its expires and signature" in unsigned.json()["detail"]
            assert anonymous.get("/api/v1/checkpoint_files/%2E%2E/sessions").status_code == 404

    for model_id, checkpoints in before.items():
        assert rest.list_checkpoints(model_id).result(timeout=30).checkpoints == checkpoints
    assert (save_dir / "weights" / "ckpt" / "adapter_config.json").is_file()
    assert types.ParsedCheckpointTinkerPath.from_tinker_path(saved).checkpoint_id == "weights/ckpt"
