import os, shutil, subprocess, sys, tempfile
# Run a hidden copy of the tests (with extra cases) against the workspace's stack.py, so editing
# the tests in the workspace does not help.
tmp = tempfile.mkdtemp()
shutil.copy("stack.py", tmp)
shutil.copy("/tests/hidden_test_stack.py", tmp)
r = subprocess.run([sys.executable, "-m", "unittest", "-q", "hidden_test_stack"], cwd=tmp, capture_output=True, text=True)
if r.returncode != 0:
    sys.exit("FAIL: tests fail:\n" + r.stderr[-2000:])
print("ok")
