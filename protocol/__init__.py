"""Wire protocol of intml: packet formats shared by workers, aggregators and tools."""
