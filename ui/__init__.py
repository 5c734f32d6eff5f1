"""ui: the Streamlit dashboard of scaletrain; it only reads telemetry's database, read-only.

`ui.launch.run_ui` starts it as `streamlit run ui/app.py` with the URL in SCALETRAIN_DB_URL.
"""
