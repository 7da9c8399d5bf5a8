"""The mitmproxy addon scripts (``mitmdump -s addons/polar_capture.py``). Installed as the package
``polar_train.addons`` (setup.cfg), so a wheel holds them too: ``polar-train addon`` prints the path."""
