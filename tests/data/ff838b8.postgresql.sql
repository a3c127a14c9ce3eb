-- the schema of commit ff838b8 (postgresql), as its create_all made it

CREATE TABLE checkpoints (
	tree_size BIGINT NOT NULL, 
	root_hash VARCHAR(64) NOT NULL, 
	created_at VARCHAR(32) NOT NULL, 
	frontier JSON NOT NULL, 
	PRIMARY KEY (tree_size)
);

CREATE TABLE dataset_schema (
	id INTEGER NOT NULL, 
	name VARCHAR(128) NOT NULL, 
	n_features INTEGER NOT NULL, 
	classes JSON NOT NULL, 
	PRIMARY KEY (id)
);

CREATE TABLE events (
	seq BIGINT NOT NULL, 
	request_id VARCHAR(128), 
	kind VARCHAR(32) NOT NULL, 
	payload TEXT NOT NULL, 
	model_version VARCHAR(128), 
	created_at VARCHAR(32) NOT NULL, 
	prev_hash VARCHAR(64) NOT NULL, 
	hash VARCHAR(64) NOT NULL, 
	PRIMARY KEY (seq)
);

CREATE INDEX ix_events_request_id ON events (request_id);

CREATE TABLE guard_usage (
	id SERIAL NOT NULL, 
	process VARCHAR(128) NOT NULL, 
	version VARCHAR(64) NOT NULL, 
	period_end TIMESTAMP WITH TIME ZONE NOT NULL, 
	certain INTEGER NOT NULL, 
	noised INTEGER NOT NULL, 
	fresh_noised INTEGER NOT NULL, 
	epsilon_spent FLOAT NOT NULL, 
	PRIMARY KEY (id)
);

CREATE INDEX ix_guard_usage_period_end ON guard_usage (period_end);

CREATE INDEX ix_guard_usage_version ON guard_usage (version);

CREATE TABLE model_pointer (
	name VARCHAR(64) NOT NULL, 
	version VARCHAR(64) NOT NULL, 
	seq BIGINT NOT NULL, 
	updated_at TIMESTAMP WITH TIME ZONE NOT NULL, 
	PRIMARY KEY (name)
);

CREATE TABLE model_versions (
	name VARCHAR(64) NOT NULL, 
	version VARCHAR(64) NOT NULL, 
	seq BIGINT NOT NULL, 
	parent VARCHAR(64), 
	manifest JSON NOT NULL, 
	created_at TIMESTAMP WITH TIME ZONE NOT NULL, 
	PRIMARY KEY (name, version)
);

CREATE INDEX ix_model_versions_seq ON model_versions (seq);

CREATE TABLE requests (
	id SERIAL NOT NULL, 
	request_id VARCHAR(128) NOT NULL, 
	op VARCHAR(16) NOT NULL, 
	subject_id VARCHAR(128), 
	record_ids JSON NOT NULL, 
	expanded_from_subject BOOLEAN NOT NULL, 
	requested_at VARCHAR(64), 
	source VARCHAR(16) NOT NULL, 
	source_topic VARCHAR(255), 
	source_partition INTEGER, 
	source_offset BIGINT, 
	received_at TIMESTAMP WITH TIME ZONE NOT NULL, 
	received_seq BIGINT NOT NULL, 
	status VARCHAR(16) NOT NULL, 
	claimed_by VARCHAR(128), 
	claimed_at TIMESTAMP WITH TIME ZONE, 
	duplicate_count INTEGER NOT NULL, 
	PRIMARY KEY (id)
);

CREATE UNIQUE INDEX ix_requests_request_id ON requests (request_id);

CREATE INDEX ix_requests_status ON requests (status);

CREATE INDEX ix_requests_subject_id ON requests (subject_id);

CREATE TABLE seed_lineages (
	name VARCHAR(64) NOT NULL, 
	lineage VARCHAR(64) NOT NULL, 
	epsilon_per_answer FLOAT NOT NULL, 
	delta FLOAT NOT NULL, 
	epsilon_budget FLOAT NOT NULL, 
	answers_allowed BIGINT NOT NULL, 
	answers_reserved BIGINT NOT NULL, 
	created_at TIMESTAMP WITH TIME ZONE NOT NULL, 
	exhausted_at TIMESTAMP WITH TIME ZONE, 
	PRIMARY KEY (name, lineage)
);

CREATE TABLE source_offsets (
	topic VARCHAR(255) NOT NULL, 
	partition INTEGER NOT NULL, 
	next_offset BIGINT NOT NULL, 
	PRIMARY KEY (topic, partition)
);

CREATE TABLE training_records (
	record_id VARCHAR(128) NOT NULL, 
	subject_id VARCHAR(128), 
	features JSON, 
	label INTEGER, 
	record_hash VARCHAR(64) NOT NULL, 
	state VARCHAR(16) NOT NULL, 
	added_by VARCHAR(128), 
	added_at TIMESTAMP WITH TIME ZONE, 
	purged_by VARCHAR(128), 
	purged_at TIMESTAMP WITH TIME ZONE, 
	PRIMARY KEY (record_id)
);

CREATE INDEX ix_training_records_state ON training_records (state);

CREATE INDEX ix_training_records_subject_id ON training_records (subject_id);
