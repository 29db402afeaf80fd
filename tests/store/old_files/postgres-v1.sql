--
-- PostgreSQL database dump
--


-- Dumped from database version 15.20 (Debian 15.20-0+deb12u1)
-- Dumped by pg_dump version 15.20 (Debian 15.20-0+deb12u1)

SET statement_timeout = 0;
SET lock_timeout = 0;
SET idle_in_transaction_session_timeout = 0;
SET client_encoding = 'UTF8';
SET standard_conforming_strings = on;
SELECT pg_catalog.set_config('search_path', '', false);
SET check_function_bodies = false;
SET xmloption = content;
SET client_min_messages = warning;
SET row_security = off;

--
-- Name: old_run; Type: SCHEMA; Schema: -; Owner: -
--

CREATE SCHEMA old_run;


SET default_tablespace = '';

SET default_table_access_method = heap;

--
-- Name: batches; Type: TABLE; Schema: old_run; Owner: -
--

CREATE TABLE old_run.batches (
    step bigint NOT NULL,
    header bytea NOT NULL,
    items bigint[] NOT NULL
);


--
-- Name: buffers; Type: TABLE; Schema: old_run; Owner: -
--

CREATE TABLE old_run.buffers (
    env_id bigint NOT NULL,
    data bytea NOT NULL
);


--
-- Name: counts; Type: TABLE; Schema: old_run; Owner: -
--

CREATE TABLE old_run.counts (
    env_id bigint NOT NULL,
    items bigint NOT NULL,
    groups bigint NOT NULL,
    seqs bigint NOT NULL,
    tokens bigint NOT NULL
);


--
-- Name: kv; Type: TABLE; Schema: old_run; Owner: -
--

CREATE TABLE old_run.kv (
    key text NOT NULL,
    value text NOT NULL
);


--
-- Name: meta; Type: TABLE; Schema: old_run; Owner: -
--

CREATE TABLE old_run.meta (
    key text NOT NULL,
    value bigint NOT NULL
);


--
-- Name: payloads; Type: TABLE; Schema: old_run; Owner: -
--

CREATE TABLE old_run.payloads (
    item_id bigint NOT NULL,
    payload bytea NOT NULL
);
ALTER TABLE ONLY old_run.payloads ALTER COLUMN payload SET STORAGE EXTERNAL;


--
-- Name: queue; Type: TABLE; Schema: old_run; Owner: -
--

CREATE TABLE old_run.queue (
    env_id bigint NOT NULL,
    item_id bigint NOT NULL,
    seqs bigint NOT NULL,
    tokens bigint NOT NULL,
    policy_step bigint NOT NULL,
    n_groups bigint NOT NULL
);


--
-- Name: replies; Type: TABLE; Schema: old_run; Owner: -
--

CREATE TABLE old_run.replies (
    key text NOT NULL,
    reply text NOT NULL,
    created double precision NOT NULL,
    seq bigint NOT NULL
);


--
-- Name: replies_seq_seq; Type: SEQUENCE; Schema: old_run; Owner: -
--

ALTER TABLE old_run.replies ALTER COLUMN seq ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME old_run.replies_seq_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);


--
-- Data for Name: batches; Type: TABLE DATA; Schema: old_run; Owner: -
--



--
-- Data for Name: buffers; Type: TABLE DATA; Schema: old_run; Owner: -
--

INSERT INTO old_run.buffers VALUES (0, '\x9194021000c501548ca17601a6656e765f696400ab706f6c6963795f7374657000a867726f75705f6964c0a76c656e67746873c4080800000008000000a6746f6b656e73c440a6a9010092280200710402009b2b010009270200043c0200863802005d2f0000148c0100b9fe0100b4800000b73e01002ac60000a41002007a23000095170100a56d61736b73c4409cffffff9cffffff9cffffff9cffffff09270200043c0200863802005d2f00009cffffff9cffffff9cffffff9cffffff2ac60000a41002007a23000095170100a673636f726573c4100000000000000000000000000000f03faa616476616e7461676573c0ac7265665f6c6f6770726f6273c0b2696e666572656e63655f6c6f6770726f6273c4400000803f0000803f0000803f0000803f35b4f0befe89cbbed8489dbe2f4a42bf0000803f0000803f0000803f0000803ff3dcb8bcea353fbf632015c040a9e3bea46d65746180');


--
-- Data for Name: counts; Type: TABLE DATA; Schema: old_run; Owner: -
--

INSERT INTO old_run.counts VALUES (0, 3, 3, 12, 96);


--
-- Data for Name: kv; Type: TABLE DATA; Schema: old_run; Owner: -
--

INSERT INTO old_run.kv VALUES ('step', '0');
INSERT INTO old_run.kv VALUES ('run', '{"registration":{"wandb_group":"g","wandb_project":"p","batch_size":8,"max_token_len":512,"checkpoint_dir":"ckpt","save_checkpoint_interval":10,"starting_step":0,"num_steps":100,"max_batch_tokens":null,"min_batch_fill":0.9,"max_staleness":null,"drop_zero_variance":false,"min_score":null,"max_score":null},"started":true}');
INSERT INTO old_run.kv VALUES ('envs', '[{"env_id":0,"desired_name":"math","wandb_name":"math_0","weight":1.0,"group_size":4,"max_token_length":512,"min_batch_allocation":null,"connected":true}]');
INSERT INTO old_run.kv VALUES ('stats:received', '{"math_0":4}');


--
-- Data for Name: meta; Type: TABLE DATA; Schema: old_run; Owner: -
--

INSERT INTO old_run.meta VALUES ('schema_version', 1);
INSERT INTO old_run.meta VALUES ('next_item_id', 4);


--
-- Data for Name: payloads; Type: TABLE DATA; Schema: old_run; Owner: -
--

INSERT INTO old_run.payloads VALUES (1, '\x8ca17601a6656e765f696400ab706f6c6963795f7374657000a867726f75705f6964a3672d31a76c656e67746873c41008000000080000000800000008000000a6746f6b656e73c48042150100e52b01007bba0100e92c02006b1400007754000031e20100d92b02003e790100074201003c320000251000002efb010082b90100f2ea0100513b0100673c02008a4e000098e0000032ec00009c110200367700004a260100b3990000edb6010078330200f7350000aea80100c3ab0000203d0100f31d02003da20000a56d61736b73c4809cffffff9cffffff9cffffff9cffffff6b1400007754000031e20100d92b02009cffffff9cffffff9cffffff9cffffff2efb010082b90100f2ea0100513b01009cffffff9cffffff9cffffff9cffffff9c110200367700004a260100b39900009cffffff9cffffff9cffffff9cffffffc3ab0000203d0100f31d02003da20000a673636f726573c4200000000000000000000000000000f03f0000000000000000000000000000f03faa616476616e7461676573c0ac7265665f6c6f6770726f6273c0b2696e666572656e63655f6c6f6770726f6273c4800000803f0000803f0000803f0000803f569c3bbeef426cbdc05f66bfa04d7fbe0000803f0000803f0000803f0000803fee22ecbdf8ae56bf969fd5bd0b48c9be0000803f0000803f0000803f0000803f9d89a9bf68a80ebfb616e6be07c2b5bf0000803f0000803f0000803f0000803f858aa1bd52c486c0aa9af1bd9e999ebfa46d65746180');
INSERT INTO old_run.payloads VALUES (2, '\x8ca17601a6656e765f696400ab706f6c6963795f7374657000a867726f75705f6964c0a76c656e67746873c41008000000080000000800000008000000a6746f6b656e73c480c4ea0100499900000b400000e5ae000078f2000015dd01006a080100db350000154701001da10000fa750000368101001fb30000734901006f980000ed570000d2230200db36020087fc01003b900100c1de000077e500004f170000b76d00003b3c020069ba0000b1130200881d02001f830000ec130100a24d01007f960100a56d61736b73c4809cffffff9cffffff9cffffff9cffffff78f2000015dd01006a080100db3500009cffffff9cffffff9cffffff9cffffff1fb30000734901006f980000ed5700009cffffff9cffffff9cffffff9cffffffc1de000077e500004f170000b76d00009cffffff9cffffff9cffffff9cffffff1f830000ec130100a24d01007f960100a673636f726573c4200000000000000000000000000000f03f0000000000000000000000000000f03faa616476616e7461676573c0ac7265665f6c6f6770726f6273c0b2696e666572656e63655f6c6f6770726f6273c4800000803f0000803f0000803f0000803fa5481bbfb17d2bbfbb8efdbdb0acb2bd0000803f0000803f0000803f0000803fbe54edbee7c108bfd96f62bedd84b2bf0000803f0000803f0000803f0000803f52b933bdf16d9fbefdb26bbf905b44bf0000803f0000803f0000803f0000803fcf348ebe3e5881be56eadebd908342bea46d65746180');
INSERT INTO old_run.payloads VALUES (3, '\x8ca17601a6656e765f696400ab706f6c6963795f7374657000a867726f75705f6964c0a76c656e67746873c41008000000080000000800000008000000a6746f6b656e73c4807ddb01002f32000024690000c18a0000446a00007fd5010050fd01001c550100209501006aae0100271300009a420000ea0801003ce5000035080200c72e0100aacc010086a600007ebb0000027c0100127d0100f097010054fd010084ab0000411900007c0a020047840100de5601005d8f000028140100876f000017c50100a56d61736b73c4809cffffff9cffffff9cffffff9cffffff446a00007fd5010050fd01001c5501009cffffff9cffffff9cffffff9cffffffea0801003ce5000035080200c72e01009cffffff9cffffff9cffffff9cffffff127d0100f097010054fd010084ab00009cffffff9cffffff9cffffff9cffffff5d8f000028140100876f000017c50100a673636f726573c4200000000000000000000000000000f03f0000000000000000000000000000f03faa616476616e7461676573c0ac7265665f6c6f6770726f6273c0b2696e666572656e63655f6c6f6770726f6273c4800000803f0000803f0000803f0000803f6cde2fbe050304bee17c5ebe6c1c52bd0000803f0000803f0000803f0000803fcd7608be3c8624bfa11984be3e3182bf0000803f0000803f0000803f0000803f2cde6bba8a1f15bfe3f8e4be68ac1bbf0000803f0000803f0000803f0000803f385fa9bc340a8abf0a0a35bff94d06bda46d65746180');


--
-- Data for Name: queue; Type: TABLE DATA; Schema: old_run; Owner: -
--

INSERT INTO old_run.queue VALUES (0, 1, 4, 32, 0, 1);
INSERT INTO old_run.queue VALUES (0, 2, 4, 32, 0, 1);
INSERT INTO old_run.queue VALUES (0, 3, 4, 32, 0, 1);


--
-- Data for Name: replies; Type: TABLE DATA; Schema: old_run; Owner: -
--

INSERT INTO old_run.replies OVERRIDING SYSTEM VALUE VALUES ('g:0:g-1', '{"status":"received","content_digest":"89d33dd518f40121bf7bf57286fbcc58"}', 1795466484.0954597, 1);


--
-- Name: replies_seq_seq; Type: SEQUENCE SET; Schema: old_run; Owner: -
--

SELECT pg_catalog.setval('old_run.replies_seq_seq', 1, true);


--
-- Name: batches batches_pkey; Type: CONSTRAINT; Schema: old_run; Owner: -
--

ALTER TABLE ONLY old_run.batches
    ADD CONSTRAINT batches_pkey PRIMARY KEY (step);


--
-- Name: buffers buffers_pkey; Type: CONSTRAINT; Schema: old_run; Owner: -
--

ALTER TABLE ONLY old_run.buffers
    ADD CONSTRAINT buffers_pkey PRIMARY KEY (env_id);


--
-- Name: counts counts_pkey; Type: CONSTRAINT; Schema: old_run; Owner: -
--

ALTER TABLE ONLY old_run.counts
    ADD CONSTRAINT counts_pkey PRIMARY KEY (env_id);


--
-- Name: kv kv_pkey; Type: CONSTRAINT; Schema: old_run; Owner: -
--

ALTER TABLE ONLY old_run.kv
    ADD CONSTRAINT kv_pkey PRIMARY KEY (key);


--
-- Name: meta meta_pkey; Type: CONSTRAINT; Schema: old_run; Owner: -
--

ALTER TABLE ONLY old_run.meta
    ADD CONSTRAINT meta_pkey PRIMARY KEY (key);


--
-- Name: payloads payloads_pkey; Type: CONSTRAINT; Schema: old_run; Owner: -
--

ALTER TABLE ONLY old_run.payloads
    ADD CONSTRAINT payloads_pkey PRIMARY KEY (item_id);


--
-- Name: queue queue_pkey; Type: CONSTRAINT; Schema: old_run; Owner: -
--

ALTER TABLE ONLY old_run.queue
    ADD CONSTRAINT queue_pkey PRIMARY KEY (env_id, item_id);


--
-- Name: replies replies_pkey; Type: CONSTRAINT; Schema: old_run; Owner: -
--

ALTER TABLE ONLY old_run.replies
    ADD CONSTRAINT replies_pkey PRIMARY KEY (key);


--
-- Name: replies_by_age; Type: INDEX; Schema: old_run; Owner: -
--

CREATE INDEX replies_by_age ON old_run.replies USING btree (created);


--
-- Name: replies_by_seq; Type: INDEX; Schema: old_run; Owner: -
--

CREATE INDEX replies_by_seq ON old_run.replies USING btree (seq);


--
-- PostgreSQL database dump complete
--


