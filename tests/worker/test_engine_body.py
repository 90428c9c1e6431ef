from services.worker.vllm_engine import build_engine_argv, engine_body
from tollgate.models.catalog import ModelEntry


def test_stream_always_asks_for_usage_and_keeps_client_options() -> None:
    body = {"model": "m", "stream": True, "stream_options": {"continuous_usage_stats": True}}
    out = engine_body(body, "abc")
    assert out["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}
    assert out["request_id"] == "abc"
    assert body == {
        "model": "m",
        "stream": True,
        "stream_options": {"continuous_usage_stats": True},
    }


def test_non_stream_body_is_passed_as_is() -> None:
    out = engine_body({"model": "m", "temperature": 0.2, "n": 2}, "abc")
    assert out == {"model": "m", "temperature": 0.2, "n": 2, "request_id": "abc"}


def test_engine_argv_serves_every_name_and_keeps_catalog_args(tmp_path: object) -> None:
    entry = ModelEntry(
        id="org/m",
        source="file:///x",
        aliases=["m"],
        max_model_len=4096,
        engine_args=["--max-num-seqs", "8"],
    )
    argv = build_engine_argv(entry, tmp_path)  # type: ignore[arg-type]
    assert argv[:2] == ["--model", str(tmp_path)]
    i = argv.index("--served-model-name")
    assert argv[i + 1 : i + 3] == ["org/m", "m"]
    assert argv[argv.index("--max-model-len") + 1] == "4096"
    assert argv[-2:] == ["--max-num-seqs", "8"]
