import sys
orig = open("/tests/dotenv").read().splitlines()
want = [("DEBUG=false" if l.startswith("DEBUG=") else l) for l in orig] + ["LOG_LEVEL=info"]
try:
    got = open(".env").read().splitlines()
except FileNotFoundError:
    sys.exit("FAIL: .env is missing")
if got != want:
    sys.exit(f"FAIL: .env is {got}")
print("ok")
