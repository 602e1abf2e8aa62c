"""Kitty Lab: `streamlit run app.py`. The entry page: load a model and compare the methods' byte budgets."""

import pandas as pd
import streamlit as st

from kitty_core import PRESETS, ModelLoadError, load_model
from kitty_core.hf import model_shape

st.set_page_config(page_title="Kitty Lab", layout="wide")


@st.cache_resource(max_entries=1, show_spinner=False)
def cached_model(name: str):
    return load_model(name)


st.title("Kitty Lab")
st.caption("2-bit KV cache quantization with channel-wise precision boost (Kitty, MLSys 2026)")
name = st.sidebar.text_input("Model", "demo", help="demo | hub id | local directory | file.gguf")
try:
    with st.spinner(f"Loading {name} ..."):
        lm = cached_model(name)
except ModelLoadError as err:
    st.error(str(err))
    st.stop()

shape = model_shape(lm.model.config)
st.sidebar.write(f"**{lm.name}** on {lm.device} ({str(lm.dtype).removeprefix('torch.')})")
st.sidebar.json(shape)
rows = [{"method": m, "bits per element": c.bits_per_element(shape["head_dim"]),
         "KV bytes per token (pages)": c.bits_per_element(shape["head_dim"]) / 8 * 2 * shape["head_dim"]
         * shape["kv_heads"] * shape["layers"]} for m, c in PRESETS.items()]
st.subheader("Byte budget per method, this model")
st.dataframe(pd.DataFrame(rows), hide_index=True)
