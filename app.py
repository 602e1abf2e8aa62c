"""Kitty Lab: `streamlit run app.py`. The entry point names the seven pages; each page draws the shared
sidebar (model, method, boost rate) itself, from `kitty_app`. An error a page does not handle reaches
the browser as one line with the traceback in an expander (`kitty_app.failed`), and the app runs on."""

import streamlit as st

from kitty_app import failed

PAGES = [
    ("pages/0_Overview.py", "Overview", ":material/view_timeline:"),
    ("pages/1_Key_statistics.py", "Key statistics", ":material/grid_on:"),
    ("pages/2_Sensitivity.py", "Sensitivity", ":material/scatter_plot:"),
    ("pages/3_Boost_rate.py", "Boost rate", ":material/tune:"),
    ("pages/4_Generations.py", "Generations", ":material/chat:"),
    ("pages/5_Memory_and_throughput.py", "Memory and throughput", ":material/speed:"),
    ("pages/6_Where_the_error_comes_from.py", "Where the error comes from", ":material/troubleshoot:"),
]

page = st.navigation([st.Page(path, title=title, icon=icon, default=i == 0)
                     for i, (path, title, icon) in enumerate(PAGES)])
try:
    page.run()
except Exception as err:  # noqa: BLE001  (Streamlit's stop and rerun are not Exceptions: they pass)
    failed(err, f"{page.title} stopped on an error")
