"""The page "Where the error comes from", headless (Streamlit's AppTest) on the demo model on CPU: the
saved run draws every chart, another method or layer is drawn, a bad input shows an error."""

import base64
import json
from pathlib import Path

import numpy as np
from streamlit.testing.v1 import AppTest

ROOT = Path(__file__).resolve().parent.parent
PAGE = str(ROOT / "pages" / "6_Where_the_error_comes_from.py")


def run() -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=1800)
    at.run()
    assert not at.exception, at.exception
    return at


def charts(at: AppTest) -> list[dict]:
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def numbers(field) -> list:
    if isinstance(field, dict) and "bdata" in field:
        return np.frombuffer(base64.b64decode(field["bdata"]), dtype=field["dtype"]).tolist()
    return list(field)


def z(trace) -> np.ndarray:
    field = trace["z"]
    if isinstance(field, dict) and "bdata" in field:
        shape = [int(n) for n in str(field["shape"]).split(",")]  # plotly writes "rows, columns"
        return np.frombuffer(base64.b64decode(field["bdata"]), dtype=field["dtype"]).reshape(shape)
    return np.array(field, dtype=float)


def test_saved_run_draws_layers_heads_attention_and_a_page():
    at = run()
    bars, grid, attention, keys, values = charts(at)
    runs = {t["name"]: numbers(t["y"]) for t in bars["data"]}
    assert len(runs) == 2 and all(len(v) == 30 and max(v) > 0 for v in runs.values())
    assert z(grid["data"][0]).shape == (30, 3) and np.nanmax(z(grid["data"][0])) > 0
    fp16, method, diff = (z(t) for t in attention["data"][:3])
    assert fp16.shape == method.shape == diff.shape and np.nanmax(np.abs(diff)) > 0
    assert any("boosted" in (t.get("name") or "") for t in keys["data"])  # kitty-pro boosts 16 of 64 channels
    assert z(values["data"][0]).shape == (128, 64)
    assert any("Spearman" in c.value for c in at.caption)


def test_another_method_and_layer_are_drawn():
    at = run()
    at.sidebar.selectbox[2].set_value("kivi-k2v2").run()
    assert not at.exception
    assert "kivi-k2v2" in json.dumps(charts(at)[0]["layout"]["title"])
    layer = next(n for n in at.number_input if n.label == "Layer")
    layer.set_value(3).run()  # not the saved layer: computed from a capture of the loaded model
    assert not at.exception
    assert "Layer 3" in json.dumps(charts(at)[2]["layout"]["title"])
    at.sidebar.selectbox[2].set_value("kitty").run()  # not in the saved run: said so
    assert not at.exception and "saved run holds" in at.info[0].value


def test_a_bad_input_shows_an_error():
    at = run()
    at.radio[0].set_value("run on the loaded model").run()
    assert not at.exception and "progress bar" in at.info[0].value
    at.sidebar.radio(key="sb_source").set_value("My text").run()  # an empty text box
    at.button[0].click().run()
    assert not at.exception and "the text has 0 tokens" in at.error[0].value
