"""`nanoserve router`: cache-aware routing over nanoserve servers on several machines (app.py)."""
