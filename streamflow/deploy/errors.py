"""Why a bundle is refused: one exception class per reason, each with a stable ``reason`` code.

The code is what a device reports to the release server (``"tampered: ipv@3: files/job.py ..."``);
the message names the bundle (``task@version``) and the file or field at fault.

Example:
    >>> err = DigestMismatch("sha256 of models/m.onnx is 9f86..., the manifest says 2c26...", bundle="ipv@3")
    >>> err.reason, str(err)
    ('tampered', 'ipv@3: sha256 of models/m.onnx is 9f86..., the manifest says 2c26...')
    >>> isinstance(err, BundleError)
    True
"""

from __future__ import annotations


class BundleError(Exception):
    """A bundle that is refused; ``reason`` is a stable code, the message says what is wrong and where."""

    reason = "bad_bundle"

    def __init__(self, message: str, *, bundle: str | None = None):
        self.bundle = bundle
        self.detail = message
        super().__init__(f"{bundle}: {message}" if bundle else message)

    def report(self) -> str:
        """``"<reason>: <message>"``, the one-line form a device reports."""
        return f"{self.reason}: {self}"


class ManifestInvalid(BundleError):
    """The manifest is not valid JSON, not in canonical form, or a field is missing or wrong."""

    reason = "bad_manifest"


class UnknownKey(BundleError):
    """The manifest names a signing key this device does not trust."""

    reason = "unknown_key"


class KeyOutOfScope(BundleError):
    """The manifest is signed by a trusted key that is not trusted for this task (a publisher's scope)."""

    reason = "key_scope"


class SignatureInvalid(BundleError):
    """The signature does not verify over the manifest's bytes with the named key."""

    reason = "bad_signature"


class DigestMismatch(BundleError):
    """A file's bytes do not match the size or sha256 the signed manifest gives for it."""

    reason = "tampered"


class UnsafePath(BundleError):
    """A file name that could escape the bundle directory (absolute, ``..``, symlink, NUL, backslash...)."""

    reason = "unsafe_path"


class BundleTooLarge(BundleError):
    """More bytes or more files than the device's limits allow."""

    reason = "too_large"


class Downgrade(BundleError):
    """A version lower than the one running that is not an allowed rollback."""

    reason = "downgrade"


class DirectiveInvalid(BundleError):
    """A deploy directive from the server that is malformed or disagrees with the manifest it points to."""

    reason = "bad_directive"


class LoadFailed(BundleError):
    """The verified job module did not load: import error, no job, an invalid task, a clash with another task."""

    reason = "load_failed"


class FailedOnFirstEvents(BundleError):
    """The new version's tasks raised on every one of their first firings (or were quarantined)."""

    reason = "failed_on_first_events"


class LocallyBlocked(BundleError):
    """This exact manifest already failed on this device; it is not installed again."""

    reason = "locally_blocked"
