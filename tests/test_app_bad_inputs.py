"""The lab under bad input and ordinary mishaps (Streamlit's AppTest, the demo model on CPU): choices
kept across pages, no model loaded twice, a run that waits says so, a stopped run keeps its text, a
fixed form drops its old error, texts too short to measure are refused, and an unexpected error is a
message with its details folded away, never a traceback. Every wait is for the script's end."""

import threading
from pathlib import Path

from streamlit.testing.v1 import AppTest

ROOT = Path(__file__).resolve().parent.parent


def run(page: str, at: AppTest | None = None) -> AppTest:
    at = at or AppTest.from_file(str(ROOT / page), default_timeout=1800)
    at.run()
    assert not at.exception, at.exception
    return at


def test_sidebar_choices_survive_a_page_switch_without_a_reload(monkeypatch):
    import kitty_app

    loads = []
    load = kitty_app.load_model
    monkeypatch.setattr(kitty_app, "load_model", lambda *a, **kw: loads.append((a, kw)) or load(*a, **kw))
    at = run("app.py")
    at.sidebar.selectbox(key="sb_dtype").set_value("float32").run()
    at.sidebar.selectbox(key="sb_method").set_value("kitty").run()
    at.sidebar.slider(key="sb_boost").set_value(0.5).run()
    at.sidebar.radio(key="sb_source").set_value("My text").run()
    at.sidebar.text_area(key="sb_text").set_value("In the beginning.").run()
    assert not at.exception, at.exception
    before = len(loads)
    at.switch_page("pages/1_Key_statistics.py").run()
    at.switch_page("pages/0_Overview.py").run()
    assert not at.exception, at.exception
    assert at.sidebar.selectbox(key="sb_dtype").value == "float32"
    assert at.sidebar.selectbox(key="sb_method").value == "kitty" and at.sidebar.slider(key="sb_boost").value == 0.5
    assert at.sidebar.radio(key="sb_source").value == "My text"
    assert at.sidebar.text_area(key="sb_text").value == "In the beginning."
    assert len(loads) == before  # the model of these choices was loaded once, and not again on a switch
    # a new method starts at its own boost rate
    at.sidebar.selectbox(key="sb_method").set_value("kitty-pro").run()
    assert at.sidebar.slider(key="sb_boost").value == 0.25


def test_two_choices_of_dtype_keep_both_models(monkeypatch):
    """Two tabs on different dtypes: both models stay loaded (the policy: the last MODELS_KEPT choices),
    so neither reloads on the other's rerun."""
    import kitty_app

    monkeypatch.setattr(kitty_app, "MODELS_KEPT", 2)
    loads = []
    load = kitty_app.load_model
    monkeypatch.setattr(kitty_app, "load_model", lambda *a, **kw: loads.append(kw["dtype"]) or load(*a, **kw))
    first, second = run("pages/0_Overview.py"), run("pages/0_Overview.py")
    second.sidebar.selectbox(key="sb_dtype").set_value("bfloat16").run()
    loaded = len(loads)
    first.run()
    second.run()
    first.run()
    assert len(loads) == loaded and loads.count("bfloat16") == 1
    assert ("demo", "auto", "auto") in kitty_app.loaded_models() and ("demo", "auto", "bfloat16") in kitty_app.loaded_models()
    assert any("Models kept loaded: at most 2" in c.value for c in first.sidebar.caption)
    assert any("bfloat16" in c.value for c in second.sidebar.caption)


def test_a_run_that_waits_for_another_says_so():
    def script():
        import threading

        import streamlit as st

        from kitty_app import gpu_lock, gpu_turn

        lock = gpu_lock()
        lock.acquire()  # another run holds the lock; it lets go in a moment, whenever that is
        threading.Timer(0.2, lock.release).start()
        with gpu_turn("The test run"):
            st.write("ran")

    at = AppTest.from_function(script, default_timeout=60).run()
    assert not at.exception and at.markdown[0].value == "ran"
    assert any("The test run waited" in c.value and "for another run to finish" in c.value for c in at.caption)
    assert threading.active_count() < 50  # the timer thread ended


def test_a_stopped_generation_keeps_its_text(monkeypatch):
    """Stop raises Streamlit's StopException inside the run, at its next element; what was streamed
    stays on the page with a note, on the next rerun too."""
    from streamlit.runtime.scriptrunner_utils.exceptions import StopException

    import kitty_core.generate

    def stopped_midway(model, tok, prompt, methods, new_tokens, on_text=None, **kw):
        on_text("fp16", "In the")
        on_text("fp16", "In the beginning")
        raise StopException()

    monkeypatch.setattr(kitty_core.generate, "compare_generations", stopped_midway)
    at = run("pages/4_Generations.py")
    at.radio(key="prompt_kind").set_value("Short prompt").run()
    at.button[0].click().run()
    at.run()  # the next rerun, as any click after Stop makes
    assert not at.exception, at.exception
    assert any("stopped before it finished" in w.value for w in at.warning)
    assert any(m.value == "In the beginning" for m in at.markdown)
    assert any("stopped after 2 tokens" in c.value for c in at.caption)


def test_a_fixed_passkey_form_drops_its_old_error():
    at = run("pages/4_Generations.py")
    at.text_input(key="pk_lengths").set_value("30000")  # parses, but is beyond the context
    at.button[-1].click().run()
    assert [e.value for e in at.error] == ["length 30000 exceeds the model's context of 8192 tokens"]
    at.text_input(key="pk_lengths").set_value("300,abc")  # the next submission: its own error alone
    at.button[-1].click().run()
    assert [e.value for e in at.error] == ["Passkey settings: lengths: 'abc' is not a whole number; give numbers separated by commas, "
                                         "e.g. 512,1024"]
    at.multiselect[-1].set_value(["fp16"])  # one method: the run that shows the form fixed stays short
    at.text_input(key="pk_lengths").set_value("300")
    at.text_input(key="pk_depths").set_value("0.5")
    at.button[-1].click().run()
    assert not at.exception and not at.error


def test_sensitivity_refuses_a_text_too_short_to_measure():
    at = run("pages/2_Sensitivity.py")
    at.sidebar.radio(key="sb_source").set_value("My text").run()
    at.sidebar.text_area(key="sb_text").set_value("In the beginning God created the heaven and the earth.").run()
    assert not at.exception, at.exception
    assert any("too short to measure" in e.value and "160 tokens" in e.value for e in at.error)
    assert not at.get("plotly_chart")  # no empty chart, no Spearman of nothing


def test_an_unexpected_error_is_a_message_not_a_traceback(monkeypatch):
    import kitty_core.memory

    def broken(*a, **kw):
        raise RuntimeError("the memory table broke\nsecond line")

    monkeypatch.setattr(kitty_core.memory, "memory_table", broken)
    at = run("app.py")
    assert any("Overview stopped on an error: RuntimeError: the memory table broke" in e.value for e in at.error)
    assert "Traceback" in at.expander[0].code[0].value and "broken" in at.expander[0].code[0].value
    at.switch_page("pages/1_Key_statistics.py").run()  # the app runs on
    assert not at.exception and not at.error and at.get("plotly_chart")
