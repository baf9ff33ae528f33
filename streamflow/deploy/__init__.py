"""Task deployment: signed bundles, a release server with staged release and rollback, the device-side updater."""
