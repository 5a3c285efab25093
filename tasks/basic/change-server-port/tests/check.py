import configparser, sys
got, orig = configparser.ConfigParser(), configparser.ConfigParser()
got.read("settings.ini")
orig.read_string(open("/tests/settings.ini").read())
orig["server"]["port"] = "9090"
as_dict = lambda c: {s: dict(c[s]) for s in c.sections()}
if as_dict(got) != as_dict(orig):
    sys.exit(f"FAIL: settings.ini holds {as_dict(got)}")
print("ok")
