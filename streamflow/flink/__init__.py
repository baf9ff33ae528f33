"""Everything Flink-specific: the runner, its keyed-state mapping, the Kafka source, the tunnel's
feature job, the local cluster and the connector jars. Nothing in the device core imports this package;
importing it alone does not import PyFlink (its modules do)."""
