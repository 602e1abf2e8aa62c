from pathlib import Path

from streamlit.testing.v1 import AppTest

APP = str(Path(__file__).resolve().parent.parent / "app.py")


def test_app_starts_on_the_demo_model():
    at = AppTest.from_file(APP, default_timeout=300).run()
    assert not at.exception
    table = at.dataframe[0].value
    assert len(table) == 8 and table.set_index("method").loc["kitty-pro", "bits per element"] < 3


def test_bad_model_shows_an_error():
    at = AppTest.from_file(APP, default_timeout=300).run()
    at.sidebar.text_input[0].set_value("/nowhere/model").run()
    assert not at.exception and "looks like a path" in at.error[0].value
