import json, sys
try:
    got = json.load(open("config.json"))
except Exception as e:
    sys.exit(f"FAIL: config.json does not parse: {e}")
want = json.load(open("/tests/expected.json"))
if got != want:
    sys.exit(f"FAIL: config.json holds {got}")
print("ok")
