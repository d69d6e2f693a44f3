"""The checkpoint format: the manifest's dataclasses and encoding (manifest), the one
validator of untrusted manifests (validate), chunk codecs and checksums (codec), and
reading a tier's steps (reader)."""
